"""One stacked second-order meta-step of 2 small tasks on the tiny test CLIP, for tests that compare a setting of the
step (autocast, attention precision, closed-form LayerNorm) by its products or its meta-gradient."""

from __future__ import annotations

from typing import Callable

import torch

from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss

NAMES = ["circle", "square", "red star"]


def stacked_step(tiny_clip, prompts: dict, **meta) -> tuple[Callable[[], dict], GRAMMetaLearner]:
    """``(run, learner)``: ``run()`` leaves one stacked second-order step's gradients of 2 tasks (1 support and 2 query
    images per class of 3) in ``.grad`` and returns its metrics.  ``prompts``: :class:`PromptSpec` fields; ``meta``:
    :class:`MetaSpec` fields (task batching on).  R_φ's maps are drawn non-trivial (their zero init is the identity)."""
    clip, dims = tiny_clip
    gen = torch.Generator().manual_seed(3)

    def part(shots):
        images = torch.randn(len(NAMES) * shots, 3, dims.image_size, dims.image_size, generator=gen)
        return {"classnames": NAMES, "label": torch.arange(len(NAMES)).repeat(shots), "images": images}

    tasks = [TaskBatch(part(1), part(2)) for _ in range(2)]
    spec = PromptSpec(**prompts)
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    ml = GRAMMetaLearner(theta, MetaSpec(task_batching="on", **meta))
    with torch.no_grad():
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template))
    return (lambda: ml.accumulate(tasks, loss_fn)), ml


def meta_gradients(ml: GRAMMetaLearner) -> dict[str, torch.Tensor]:
    """Copies of θ's and φ's ``.grad`` by parameter name (those that have one)."""
    return {n: p.grad.clone() for n, p in ml.named_parameters() if p.grad is not None}
