"""Meta-validation that scores the downstream protocol itself (``META.VAL_PROTOCOL downstream``).

For each held-out task, θ (with R_φ and the test-time switches) is fine-tuned on the task's support
exactly as the evaluator and the Dassl trainers fine-tune on a few-shot train set — batch 1, the
CoCoOp schedule (constant warm-up epoch, cosine), SGD with momentum and weight decay, the regulation
window and the launch step, random resized crops and flips of the support images — and the query
accuracy after the last epoch is the score.  The one-step metrics (``query_acc_after``) measure what
the inner loop optimises; this one measures what a user gets.

Cached image features (text-only prompts) cannot be re-cropped: there the support is used without
augmentation (one view), which the record says (``augmented: false``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from meta.evaluation.spec import TrainSpec
from meta.evaluation.training import LabelledSet, PromptTuner
from meta.finetune.engine import Start
from meta.method.consistency import ConsistencySpec
from meta.method.prompts import PromptedCLIP


def crop_and_flip(image: torch.Tensor, scale: tuple, generator: torch.Generator) -> torch.Tensor:
    """A random resized crop (area fraction in ``scale``, aspect ratio in [3/4, 4/3]) and a horizontal flip
    with probability 1/2 of a normalised ``[3, S, S]`` image, resized back to ``S`` (bicubic), drawn from
    ``generator`` (torchvision's RandomResizedCrop rule, on tensors, without global RNG)."""
    _, h, w = image.shape
    area = h * w
    top, left, ch, cw = 0, 0, h, w
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(scale[0], scale[1], generator=generator))
        log_ratio = torch.empty(1).uniform_(
            float(torch.log(torch.tensor(3 / 4))), float(torch.log(torch.tensor(4 / 3))), generator=generator
        )
        ratio = float(torch.exp(log_ratio))
        cw_try = int(round((target * ratio) ** 0.5))
        ch_try = int(round((target / ratio) ** 0.5))
        if 0 < cw_try <= w and 0 < ch_try <= h:
            ch, cw = ch_try, cw_try
            top = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
            left = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
            break
    crop = image[:, top : top + ch, left : left + cw].unsqueeze(0)
    out = F.interpolate(crop, size=(h, w), mode="bicubic", align_corners=False).squeeze(0)
    if bool(torch.rand(1, generator=generator) < 0.5):
        out = out.flip(-1)
    return out


def downstream_accuracy(
    pclip: PromptedCLIP,
    start: Start,
    support: dict,
    query: dict,
    spec: TrainSpec,
    seed: int,
    consistency: Optional[ConsistencySpec] = None,
) -> float:
    """Query accuracy (%) after fine-tuning ``start`` (:func:`meta.finetune.engine.build_start`'s; its θ trained in
    place) on ``support`` with ``spec`` and the ``consistency`` weights (None = plain cross-entropy); ``support`` /
    ``query``: the meta-learner's batches (``classnames``, ``label`` ``[n]``, ``features`` ``[n, E]`` or ``images``).
    """
    s_images, q_images = support.get("images"), query.get("images")
    generator = torch.Generator().manual_seed(seed)
    views: dict = {}

    def train_images(impath: str, epoch: int) -> torch.Tensor:
        key = (impath, epoch)
        if key not in views:
            views[key] = crop_and_flip(s_images[int(impath[1:])], spec.rrcrop_scale, generator)
        return views[key]

    def test_images(impath: str) -> torch.Tensor:
        return (q_images if impath[0] == "q" else s_images)[int(impath[1:])]

    def labelled(batch: dict, prefix: str, train: bool) -> LabelledSet:
        n = len(batch["label"])
        feats = batch.get("features")
        if feats is not None:
            feats = feats.detach().unsqueeze(1) if train else feats.detach()
        return LabelledSet(
            impaths=[f"{prefix}{i}" for i in range(n)],
            labels=batch["label"].detach().cpu(),
            classnames=list(batch["classnames"]),
            features=feats,
        )

    use_spec = spec if s_images is not None else spec.replace(augment="none")
    begin = dict(reg_window=start.window, launch_step=start.launch, consistency=consistency)
    tuner = PromptTuner(pclip, start.prompts, start.regulation, use_spec, seed, train_images, test_images, **begin)
    train_set = labelled(support, "s", train=True)
    if start.launch is not None:
        tuner.launch(labelled(support, "s", train=False))
    tuner.fit(train_set)
    return tuner.accuracy(labelled(query, "q", train=False))
