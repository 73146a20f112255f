"""Episodic test-time prompt tuning: TPT (Shu et al., NeurIPS 2022) from any start θ, its gradient optionally R_φ's.

For each unlabelled test image ``x`` (``[3, H, W]``, preprocessed as the evaluator feeds CLIP): ``views`` views (``x``
first, then random resized crops with flips, drawn from a seeded generator), their logits under θ, the
``confident_share`` of lowest entropy, and the entropy of their *averaged* prediction as the loss (TPT's
``select_confident_samples`` and ``avg_entropy``, azshue/TPT ``tpt_classification.py``).  ``steps`` AdamW steps
on θ (TPT's), or with ``optimizer meta`` the init file's meta-trained step θ − α R_φ(g), R_φ replacing the
gradient when given; then the prediction on ``x``.  θ and the optimiser start afresh for every image.  TPT crops the
full-size photo; here the views are cut from the preprocessed tensor and resized back (bilinear, antialiased).  A
learner whose image side carries no prompts encodes the views once per image without gradients.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torchvision.transforms.v2 import functional as TF
from tqdm import tqdm

from meta.finetune.regulated import LaunchStep, RuleStep
from meta.infra.memory import peak_mib
from meta.method.learners import learner_of
from meta.method.prototypes import FORMS as PROTOTYPE_FORMS
from meta.method.regulator import conditioned

NO_PROMPTS = (
    "zero-shot CLIP has no prompts to tune; TPT from the hand prompt is the coop method started from those words "
    "and not fine-tuned (python -m meta.evaluation --methods coop --ctx-init 'a photo of a' --epochs 0)"
)


OPTIMIZERS = ("adamw", "meta")
ADAPTS = ("tpt", "cache")  # episodic prompt tuning (this module) | the training-free caches (meta.finetune.cache)
NO_RULE = "needs the meta-trained step of a GRAM init file (the method's init file with its launch step on)"


@dataclass(frozen=True)
class TestTimeSpec:
    """TPT's protocol (defaults: its paper, section 4, and azshue/TPT's ``tpt_classification.py``)."""

    __test__ = False  # not a pytest test class

    views: int = 64  # the test image and 63 augmented views: TPT's batch of 64
    confident_share: float = 0.1  # keep the 10 % of views with the lowest entropy
    steps: int = 1  # optimiser steps per image
    lr: float = 5e-3
    weight_decay: float = 0.01  # torch.optim.AdamW's default, which TPT keeps
    # adamw: TPT's AdamW (lr, weight_decay); meta: the init file's meta-trained step θ <- θ − α·R_φ(g) (its α, momentum
    # and weight decay: meta.finetune.regulated.RuleStep), the step META.MODE testtime meta-trains
    optimizer: str = "adamw"
    # none | nearest: R_φ conditioned on the image's relation to the init file's CHC prototypes (meta.method.prototypes;
    # under META.MODE testtime: meta-train such an R_φ and store the prototypes)
    prototypes: str = "none"
    # tpt: tune θ on each image (the rest of these fields) | cache: tune nothing, TDA's positive/negative feature
    # caches over the shuffled test stream (meta.finetune.cache; reads views and confident_share only)
    adapt: str = "tpt"
    crop_scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop's defaults (area share, aspect ratio)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        if int(self.views) < 1:
            raise ValueError(f"test-time views: expected an integer >= 1 (the image counts as one), got {self.views}")
        if not 0.0 < float(self.confident_share) <= 1.0:
            raise ValueError(f"test-time confident_share: expected a share in (0, 1], got {self.confident_share}")
        if int(self.steps) < 0:
            raise ValueError(f"test-time steps: expected an integer >= 0, got {self.steps}")
        if not float(self.lr) > 0.0:
            raise ValueError(f"test-time lr: expected a learning rate > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"test-time optimizer: expected {' | '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.adapt not in ADAPTS:
            raise ValueError(f"test-time adapt: expected {' | '.join(ADAPTS)}, got {self.adapt!r}")
        if self.prototypes not in PROTOTYPE_FORMS:
            raise ValueError(f"test-time prototypes: expected {' | '.join(PROTOTYPE_FORMS)}, got {self.prototypes!r}")

    @property
    def kept(self) -> int:
        """Confident views the loss averages: ``int(views · share)`` as TPT counts them, at least one."""
        return max(1, int(self.views * self.confident_share))


def spec_from(values: dict, key_of: Callable[[str], str]) -> TestTimeSpec:
    """:class:`TestTimeSpec` of ``values`` (``{field: value}``), its one-line error naming the user's key
    ``key_of(field)`` (``"views"`` -> ``"--test-time-views"`` or ``"TRAINER.GRAM.TEST_TIME.VIEWS"``)."""
    try:
        return TestTimeSpec(**values)
    except ValueError as err:  # "test-time views: expected ..."
        field, _, what = str(err).removeprefix("test-time ").partition(": ")
        raise ValueError(f"{key_of(field)}: {what}") from None


def crop_box(height: int, width: int, spec: TestTimeSpec, generator: torch.Generator) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random resized crop: RandomResizedCrop's rule (10 draws of area share and log-uniform
    aspect ratio, else the whole image clipped to the ratio range) with draws from ``generator``."""
    area = height * width
    log_ratio = (math.log(spec.crop_ratio[0]), math.log(spec.crop_ratio[1]))
    for _ in range(10):
        u = torch.rand(2, generator=generator).tolist()
        target = area * (spec.crop_scale[0] + u[0] * (spec.crop_scale[1] - spec.crop_scale[0]))
        ratio = math.exp(log_ratio[0] + u[1] * (log_ratio[1] - log_ratio[0]))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            return top, left, h, w
    ratio = min(max(width / height, spec.crop_ratio[0]), spec.crop_ratio[1])
    w, h = (width, round(width / ratio)) if width / height > ratio else (round(height * ratio), height)
    w, h = min(w, width), min(h, height)
    return (height - h) // 2, (width - w) // 2, h, w


def view_batch(image: torch.Tensor, spec: TestTimeSpec, generator: torch.Generator) -> torch.Tensor:
    """``[views, 3, H, W]``: ``image`` (``[3, H, W]``) first, then ``views - 1`` random resized crops of it, each
    flipped left-right with probability 1/2, resized back to ``H x W``."""
    _, height, width = image.shape
    out = [image]
    for _ in range(spec.views - 1):
        top, left, h, w = crop_box(height, width, spec, generator)
        view = TF.resized_crop(image, top, left, h, w, [height, width], antialias=True)
        out.append(TF.horizontal_flip(view) if float(torch.rand(1, generator=generator)) < 0.5 else view)
    return torch.stack(out)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[n]`` entropy (nats) of each row's softmax of ``logits`` ``[n, C]``."""
    log_p = logits.log_softmax(dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def confident_views(logits: torch.Tensor, kept: int) -> torch.Tensor:
    """Indices of the ``kept`` rows of ``logits`` ``[V, C]`` (or ``[..., V, C]``: per leading index) with the lowest
    entropy, most confident first: ``[kept]`` (``[..., kept]``)."""
    return torch.argsort(entropy(logits.detach()), dim=-1, stable=True)[..., :kept]


def marginal_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the averaged prediction ``mean_v softmax(logits[v])`` of ``logits`` ``[k, C]`` (TPT's loss; the
    mean is taken in log space, log-sum-exp minus log k): 0-d, or ``[...]`` for ``[..., k, C]``."""
    log_p = logits.log_softmax(dim=-1)
    log_mean = torch.logsumexp(log_p, dim=-2) - math.log(logits.shape[-2])
    log_mean = log_mean.clamp_min(torch.finfo(log_mean.dtype).min)
    return -(log_mean.exp() * log_mean).sum(dim=-1)


@dataclass
class TestTimeResult:
    """What :func:`tune_and_predict` returns: ``logits`` ``[n, C]`` on each image after its own tuning, the mean
    entropy loss before the first step (``loss_before``) and after the last (``loss_after``: NaN for a learner that
    prompts the image tower, whose views it would cost another pass of the tower to re-encode), seconds per image,
    and ``peak_mib_per_image``: the largest over the images of the resident high-water mark during one image's
    :func:`tune_one` above the resident size before it (:func:`meta.infra.memory.peak_mib`: pages the allocator
    kept from earlier work absorb part of a step, so a small step in a long process reads near 0); ``None`` off the
    CPU or where Linux offers no reset."""

    logits: torch.Tensor
    loss_before: float
    loss_after: float
    seconds_per_image: float
    peak_mib_per_image: Optional[float] = None


def check_regulation(regulation) -> None:
    """Refuse a gate-form R_φ (:attr:`meta.finetune.regulated.GradientRegulation.gated`) at test time: the entropy
    loss has no consistency regulariser for the gate to act on."""
    if regulation is not None and regulation.gated:
        raise ValueError("test-time tuning: R_φ is a gate on a regulariser's gradient; the entropy loss has none")


def check_optimizer(spec: TestTimeSpec, rule: Optional[LaunchStep]) -> None:
    """Refuse ``optimizer meta`` without the meta-trained step ``rule`` (before any work is done)."""
    if spec.optimizer == "meta" and rule is None:
        raise ValueError(f"test-time optimizer meta: {NO_RULE}")


def check_prototypes(spec: TestTimeSpec, regulation, key: str) -> None:
    """Refuse ``prototypes nearest`` (``key``: the user's name of it) unless R_φ comes with the init file's CHC
    prototypes (:attr:`meta.finetune.regulated.GradientRegulation.prototypes`) and reads them, before any work."""
    if spec.prototypes == "none":
        return
    where = f"{key} {spec.prototypes}"
    if regulation is None:
        raise ValueError(f"{where}: needs R_φ from a GRAM init file (a method that regulates)")
    if regulation.prototypes is None:
        raise ValueError(
            f"{where}: the init file holds no CHC prototypes (meta-train it with META.MODE testtime and "
            f"META.TEST_TIME.PROTOTYPES {spec.prototypes})"
        )
    if not any(r.spec.context for r in regulation.regulators.values()):
        raise ValueError(f"{where}: the init file's R_φ was not meta-trained on its prototypes (no context maps)")


def tune_one(
    pclip,
    start,
    image: torch.Tensor,
    classnames: Sequence[str],
    spec: TestTimeSpec,
    generator,
    regulation,
    rule=None,
):
    """``(logits [C] on image after tuning, loss before, loss after)`` for one image from a fresh copy of ``start``;
    ``rule``: the :class:`meta.finetune.regulated.LaunchStep` that ``spec.optimizer`` ``meta`` steps with.  With
    ``spec.prototypes`` not none, R_φ's context is the frozen image feature's relation to ``regulation.prototypes``."""
    check_optimizer(spec, rule)
    theta = copy.deepcopy(start).requires_grad_(True)
    views = view_batch(image, spec, generator)
    cached = None
    if not learner_of(theta).has_visual_prompts(theta):
        with torch.no_grad():
            cached = pclip.image_features(None, views)
    context = None
    if spec.prototypes != "none" and getattr(regulation, "prototypes", None) is not None:
        with torch.no_grad():
            feature = cached[:1] if cached is not None else pclip.image_features(None, image[None])
        context = regulation.prototypes.context(feature)[0]
    params = list(theta.parameters())
    adamw = torch.optim.AdamW
    optim = (
        RuleStep(params, rule)
        if spec.optimizer == "meta"
        else adamw(params, lr=spec.lr, weight_decay=spec.weight_decay)
    )
    losses = []
    for _ in range(spec.steps):
        logits = pclip.logits(theta, classnames, images=None if cached is not None else views, image_features=cached)
        loss = marginal_entropy(logits[confident_views(logits, spec.kept)])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if regulation is not None:
            with conditioned(regulation.regulators.values(), context):
                regulation.apply_(theta.named_parameters())
        optim.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():  # all views again only where it costs a text pass (cached view features), else the image
        logits = pclip.logits(theta, classnames, images=views[:1] if cached is None else None, image_features=cached)
        after = float(marginal_entropy(logits[confident_views(logits, spec.kept)])) if cached is not None else math.nan
    return logits[0], (losses[0] if losses else after), after


def image_generator(seed: int, index: int) -> torch.Generator:
    """The generator of image ``index``'s views under ``seed``."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(index))


def tune_and_predict(
    pclip,
    start,
    images: Sequence[torch.Tensor],
    classnames: Sequence[str],
    spec: TestTimeSpec = TestTimeSpec(),
    regulation=None,
    seed: int = 0,
    progress: bool = False,
    rule=None,
) -> TestTimeResult:
    """TPT on every image of ``images`` (``[n, 3, H, W]``, or a sequence of n ``[3, H, W]`` tensors read when their
    turn comes; module docstring), each from ``start`` (a :class:`meta.method.prompts.PromptParams`, left unchanged);
    image i's views come from a generator of its own (:func:`image_generator`), so its result does not depend on
    which images came before it.  ``progress``: a tqdm bar over the images; ``rule``: as in :func:`tune_one`."""
    if len(images) == 0 or images[0].ndim != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else f"{len(images)} images"
        raise ValueError(f"test-time tuning: expected unlabelled images [n >= 1, 3, H, W], got {shape}")
    check_regulation(regulation)
    check_optimizer(spec, rule)
    t = time.perf_counter()
    rows, peaks = [], []
    for i in tqdm(range(len(images)), desc="test-time tuning", unit="img", leave=False, disable=not progress):
        image, views = images[i], image_generator(seed, i)  # read before the measured call
        row, mib = peak_mib(lambda: tune_one(pclip, start, image, classnames, spec, views, regulation, rule))
        rows.append(row)
        peaks.append(mib if image.device.type == "cpu" else None)  # the host's memory measures a CPU run only
    return TestTimeResult(
        logits=torch.stack([r[0] for r in rows]),
        loss_before=sum(r[1] for r in rows) / len(rows),
        loss_after=sum(r[2] for r in rows) / len(rows),
        seconds_per_image=(time.perf_counter() - t) / len(rows),
        peak_mib_per_image=None if None in peaks else max(peaks),
    )


def calibration_error(logits: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error in percent of ``logits`` ``[n, C]`` against ``labels`` ``[n]``: the top-1
    confidences cut into ``bins`` equal-width bins over (0, 1], and the share-weighted mean of |accuracy − mean
    confidence| per bin (Guo et al., ICML 2017, section 2, with its 15 bins; the ECE that C-TPT, ICLR 2024, reports
    for test-time tuning)."""
    confidence, predicted = logits.detach().double().softmax(dim=-1).max(dim=-1)
    correct = (predicted == labels.to(predicted.device)).double()
    which = (confidence * bins).ceil().clamp(1, bins).long() - 1  # bin b holds (b/bins, (b+1)/bins]
    total = 0.0
    for b in range(bins):
        member = which == b
        if member.any():
            total += float(member.double().mean()) * abs(float(correct[member].mean() - confidence[member].mean()))
    return 100.0 * total
