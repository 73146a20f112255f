"""Test-time GRAM's outer objective: θ* and R_φ meta-trained for the unsupervised step they take on one test image.

For a task's query images x_1 … x_m with V views each (view 0 the image, the rest
:func:`meta.finetune.testtime.view_batch` crops) and pseudo-labels y_i among the task's K CHC topics::

    H_i(θ)  = entropy of mean_{v ∈ C_i} softmax f_θ(x_i^v)     C_i: the ``kept`` lowest-entropy views (TPT's loss)
    θ'_i    = θ − α · R_φ(∇_θ H_i(θ))                         (``inner_steps`` such steps; no label is read)
    L_out   = (1/m) Σ_i CE(f_{θ'_i}(x_i), y_i)

The inner step is :meth:`meta.method.gram.GRAMMetaLearner.unroll`, the one differentiable inner loop.  C_i is an
argsort of detached entropies, so L_out is piecewise smooth.  The query dict holds ``classnames``, ``label`` ``[m]``
and ``view_features`` ``[m, V, E]`` (a learner without visual prompts) or ``view_images`` ``[m, V, 3, H, W]``,
built by :class:`TaskViews`.  With ``prototypes`` (``META.TEST_TIME.PROTOTYPES nearest``) R_φ reads image i's context
s(z_i) (:mod:`meta.method.prototypes`, z_i its frozen feature) during its inner step, as at test time.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from meta.finetune.testtime import TestTimeSpec, confident_views, marginal_entropy, view_batch
from meta.method.batched import features as stacked_features
from meta.method.batched import stacked_learner
from meta.method.inner import LossFn
from meta.method.learners import feature_logits
from meta.method.metrics import accuracy_t
from meta.method.prototypes import Prototypes
from meta.method.regulator import conditioned, is_gated

VIEW_KEYS = ("view_features", "view_images")  # the query's views: cached features, or images for the tower


def entropy_loss(pclip, kept: int) -> LossFn:
    """``loss(θ, batch) -> (H, logits [V, K])`` on one image's views ``batch`` (``classnames`` and ``features``
    ``[V, E]`` or ``images`` ``[V, 3, H, W]``): the marginal entropy of its ``kept`` most confident views."""

    def loss(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = pclip.logits(
            prompts, batch["classnames"], images=batch.get("images"), image_features=batch.get("features")
        )
        return marginal_entropy(logits[confident_views(logits, kept)]), logits

    return loss


def stacked_entropy_loss(pclip, kept: int) -> LossFn:
    """The twin of :func:`entropy_loss` for m images at once (θ stacked per image,
    :class:`meta.method.batched.StackedPrompts`): ``loss(θ_1..θ_m, batch) -> (Σ_i H_i(θ_i), logits [m, V, K])`` on a
    stacked batch (``classnames`` m lists, ``features`` ``[m, V, E]`` or ``images`` ``[m·V, 3, H, W]``); image i's
    ``kept`` most confident views are chosen as :func:`meta.finetune.testtime.confident_views` chooses them."""

    def loss(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = feature_logits(pclip.logit_scale, *stacked_features(pclip, prompts, batch))  # [m, V, K]
        chosen = confident_views(logits, kept)  # [m, kept]
        picked = logits.gather(1, chosen[..., None].expand(-1, -1, logits.shape[-1]))  # [m, kept, K]
        return marginal_entropy(picked).sum(), logits

    return loss


def view_features(pclip, views: torch.Tensor) -> torch.Tensor:
    """``[m, V, E]`` frozen-tower features of views ``[m, V, 3, H, W]`` (no gradient)."""
    with torch.no_grad():
        return pclip.image_features(None, views.flatten(0, 1)).view(*views.shape[:2], -1)


@dataclass(frozen=True)
class TaskViews:
    """The query's views for ``META.MODE testtime`` (``TaskBatcher(views=...)``): image i of a task gets ``spec.views``
    views from a generator of (``seed``, the task's query items, i), so a task's views do not depend on the tasks
    before it (a resumed run draws the same).  Features for a learner without visual prompts, else images."""

    pclip: Any
    spec: TestTimeSpec
    seed: int
    use_images: bool

    def __call__(self, images: torch.Tensor, index: np.ndarray) -> dict:
        """``{"view_images": [m, V, 3, H, W]}`` or ``{"view_features": [m, V, E]}`` of ``images`` ``[m, 3, H, W]``."""
        task = zlib.crc32(np.asarray(index, dtype=np.int64).tobytes())
        views = []
        for i, image in enumerate(images):
            state = np.random.SeedSequence([int(self.seed), task, i]).generate_state(1)[0]
            views.append(view_batch(image, self.spec, torch.Generator().manual_seed(int(state))))
        stack = torch.stack(views)
        return {"view_images": stack} if self.use_images else {"view_features": view_features(self.pclip, stack)}


@dataclass(frozen=True)
class TestTimeObjective:
    """The objective of the module docstring; ``kept`` confident views per image (TPT: 6 of 64).  The tasks run one
    after another (the task-stacked loop of :mod:`meta.method.batched` does not run it); within a task the images run
    one at a time, or with ``META.TASK_BATCHING on`` all in one pass, θ stacked per image (:meth:`_stacked`)."""

    __test__ = False  # not a pytest test class

    kept: int
    prototypes: Optional[Prototypes] = None  # R_φ's context s(z) of each image (None: unconditioned)

    def backward(
        self,
        meta: Any,
        loss_fn: LossFn,
        support: Any,
        query: dict,
        n_tasks: int,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
        first_order: bool = False,
    ) -> tuple[Optional[nn.Module], dict[str, torch.Tensor]]:
        """Leave ``∇_{θ,φ} L_out / n_tasks`` in ``.grad`` (one backward per image, or one per task when stacked) and
        return ``(None, metrics)``: ``entropy_before`` (H_i at θ), ``query_loss_after``, ``query_acc_after`` (at θ'_i),
        means over the images.  ``loss_fn.pclip`` gives the logits; ``support`` is not read (the signature is
        ``OuterObjective.backward``'s).  ``first_order`` (validation, values only): θ'_i without the second-order
        graph; else ``META.FIRST_ORDER``."""
        if is_gated(meta.gbml.compute_update.transforms_modules):
            raise ValueError("test-time objective: META.REGULATOR.FORM gate needs a regulariser; the entropy has none")
        key = next((k for k in VIEW_KEYS if k in query), None)
        if key is None:
            raise ValueError(f"test-time objective: the query holds no views (expected one of {', '.join(VIEW_KEYS)})")
        pclip, names, labels, views = loss_fn.pclip, query["classnames"], query["label"], query[key]
        if views.shape[0] != labels.shape[0] or views.shape[0] == 0:
            raise ValueError(f"test-time objective: {key} holds {views.shape[0]} images, label {labels.shape[0]}")
        field, inner = key.removeprefix("view_"), entropy_loss(pclip, self.kept)  # "features" | "images"
        m, metrics = views.shape[0], {"entropy_before": [], "query_loss_after": [], "query_acc_after": []}
        contexts = None
        if self.prototypes is not None:  # s(z) of each image's frozen feature (view 0): [m, 2]
            images = views[:, 0] if field == "features" else view_features(pclip, views[:, :1])[:, 0]
            contexts = self.prototypes.context(images)
        regulators = meta.gbml.compute_update.transforms_modules
        if meta.task_batching.mode == "on" and m > 1:  # the task's images in one stacked pass
            return None, self._stacked(meta, pclip, query, key, contexts, n_tasks, backward, first_order)
        for i in range(m):
            batch = {"classnames": names, "label": labels[i].expand(views.shape[1]), field: views[i]}
            with conditioned(regulators, None if contexts is None else contexts[i]):
                adapted, entropies, _ = meta.unroll(inner, batch, first_order=first_order or None)
            image = {"image_features" if field == "features" else "images": views[i, :1]}  # view 0: the image
            with meta.cast():
                logits = pclip.logits(adapted.module, names, **image)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16 up, float64 kept
            loss = F.cross_entropy(logits, labels[i : i + 1])
            backward(loss / (m * n_tasks))
            metrics["entropy_before"].append(entropies[0].detach().to(loss.dtype))
            metrics["query_loss_after"].append(loss.detach())
            metrics["query_acc_after"].append(accuracy_t(logits.detach(), labels[i : i + 1]))
            del adapted
        return None, {name: torch.stack(values).mean() for name, values in metrics.items()}

    def _stacked(
        self,
        meta: Any,
        pclip: Any,
        query: dict,
        key: str,
        contexts: Optional[torch.Tensor],
        n_tasks: int,
        backward: Callable[[torch.Tensor], None],
        first_order: bool,
    ) -> dict[str, torch.Tensor]:
        """:meth:`backward`'s loop with the task's m images in one pass: θ stacked per image
        (:func:`meta.method.batched.stacked_learner`, R_φ per slice, image i's context ``contexts[i]``), the inner
        step on Σ_i H_i (so slice i's gradient is ∇H_i(θ_i)), the outer loss (1/m) Σ_i CE(f_{θ'_i}(x_i), y_i) in one
        backward.  The loop's gradients up to the order of floating-point sums (``META.TASK_BATCHING on``)."""
        names, labels, views = query["classnames"], query["label"], query[key]
        m, n_views = views.shape[:2]
        first_order = bool(first_order) or meta.spec.first_order
        inner = {"classnames": [list(names)] * m, "label": labels[:, None].expand(m, n_views)}
        outer = {"classnames": inner["classnames"]}
        if key == "view_features":
            inner["features"], outer["features"] = views, views[:, :1]  # [m, V, E], view 0 [m, 1, E]
        else:
            inner["images"], outer["images"] = views.flatten(0, 1), views[:, 0]  # [m·V, 3, H, W], view 0 [m, 3, H, W]
        with conditioned(meta.gbml.compute_update.transforms_modules, contexts):  # before the clone, which copies it
            start = stacked_learner(meta.gbml, m, first_order)
            adapted, entropies, _ = meta.unroll(
                stacked_entropy_loss(pclip, self.kept), inner, first_order=first_order, start=start
            )
        with meta.cast():
            logits = feature_logits(pclip.logit_scale, *stacked_features(pclip, adapted.module, outer))[:, 0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [m, K]
        per_image = F.cross_entropy(logits, labels, reduction="none")  # [m]
        backward(per_image.sum() / (m * n_tasks))
        return {
            "entropy_before": entropies[0].detach().to(per_image.dtype) / m,
            "query_loss_after": per_image.detach().mean(),
            "query_acc_after": accuracy_t(logits.detach(), labels),
        }
