"""A training-free test-time baseline in TDA's spirit: positive and negative feature caches over the test stream.

TDA (Karmanov et al., CVPR 2024, "Efficient Test-Time Adaptation of Vision-Language Models"; code kdiAAA/TDA,
``tda_runner.py``) tunes nothing.  The test images arrive one at a time in a shuffled order; for each image ``x``:

- its prediction from the frozen features: with ``views`` > 1 TPT's views (:func:`meta.finetune.testtime.view_batch`),
  the ``kept`` most confident of them, their mean feature ``f`` (not renormalised) and mean logits; with one view the
  image alone (TDA's cross-domain benchmark; its ImageNet-variant benchmark takes 63 views and the image);
- its entropy ``h`` (of the mean prediction, nats) and ``h / log2 C`` (TDA's normalised entropy, ``get_entropy``);
- the positive cache of its predicted class ``ŷ`` keeps up to ``pos_capacity`` (``f``, ``h``) entries, the ones of
  lowest entropy; the negative cache does the same (``neg_capacity``) for images whose normalised entropy lies
  strictly inside ``neg_entropy``, with the image's mean class probabilities ``p`` as its value;
- its logits ``s · f·T + (s / 100) (α₊ A₊(f) − α₋ A₋(f))`` with ``A(f) = Σ_entries exp(−β (1 − f·k)) · value``: the
  positive value is the one-hot ``ŷ``, the negative one the mask ``neg_mask[0] < p < neg_mask[1]``.  The caches are
  updated with ``x`` before its own logits are computed, as TDA does.

TDA writes the CLIP logits as ``100 · f·T`` (OpenAI CLIP's learned logit scale) and its α against that scale; here
the CLIP logits and the entropies are at the model's own logit scale ``s`` and the α's are rescaled by ``s / 100``, so
the cache weighs against CLIP as much as in TDA (the logits are TDA's times ``s / 100``: the same predictions for
the same caches) while the entropies keep the model's own calibration, as they are OpenAI CLIP's in TDA.

Defaults: TDA's ImageNet settings (``configs/imagenet.yaml``: positive 3 shots, α 2.0, β 5.0; negative 2 shots,
α 0.117, β 1.0, entropy (0.2, 0.5), mask (0.03, 1.0)).  Unlike episodic TPT the caches carry what earlier images
taught to later ones, so a result depends on the stream's order (a seeded shuffle here).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from meta.finetune.testtime import (
    TestTimeResult,
    TestTimeSpec,
    confident_views,
    entropy,
    image_generator,
    marginal_entropy,
    view_batch,
)
from meta.infra.memory import peak_mib

TDA_LOGIT_SCALE = 100.0  # the scale TDA's CLIP logits and its α's are written against (tda_runner.py, utils.py)


@dataclass(frozen=True)
class CacheSpec:
    """The two caches' settings (defaults: TDA's ``configs/imagenet.yaml``)."""

    pos_capacity: int = 3  # entries kept per predicted class
    pos_alpha: float = 2.0
    pos_beta: float = 5.0
    neg_capacity: int = 2
    neg_alpha: float = 0.117
    neg_beta: float = 1.0
    neg_entropy: tuple[float, float] = (0.2, 0.5)  # normalised entropy an image needs (strictly) to enter the cache
    neg_mask: tuple[float, float] = (0.03, 1.0)  # class probabilities (strictly) inside mark a negative class


@dataclass
class ClassCache:
    """Per predicted class, up to ``capacity`` entries ``(key [E], entropy, value [C])``, lowest entropy first."""

    capacity: int
    entries: dict[int, list[tuple[torch.Tensor, float, torch.Tensor]]] = field(default_factory=dict)

    def offer(self, label: int, key: torch.Tensor, loss: float, value: torch.Tensor) -> None:
        """Keep the entry if class ``label`` has room, else let it replace that class's highest-entropy entry when
        its own entropy is lower."""
        kept = self.entries.setdefault(label, [])
        if len(kept) < self.capacity:
            kept.append((key, loss, value))
        elif loss < kept[-1][1]:
            kept[-1] = (key, loss, value)
        kept.sort(key=lambda entry: entry[1])

    def affinity_logits(self, feature: torch.Tensor, beta: float) -> Optional[torch.Tensor]:
        """``[C]``: Σ over entries of exp(−β (1 − feature·key)) · value (``None`` while empty); ``feature`` ``[E]``."""
        rows = [entry for label in sorted(self.entries) for entry in self.entries[label]]
        if not rows:
            return None
        keys = torch.stack([r[0] for r in rows])  # [N, E]
        values = torch.stack([r[2] for r in rows])  # [N, C]
        weights = torch.exp(-beta * (1.0 - keys @ feature))  # [N]
        return weights @ values


def predict_one(
    features: torch.Tensor, text: torch.Tensor, scale: float, kept: int
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, int]:
    """``(f [E], logits [C], entropy, probabilities [C], predicted class)`` of one image's view features ``[V, E]``
    (L2-normalised) against class embeddings ``text`` ``[C, E]`` at logit ``scale``: with V > 1 the ``kept`` most
    confident views averaged (features, logits and probabilities), the entropy that of their mean prediction."""
    logits = scale * features @ text.T  # [V, C]
    if features.shape[0] > 1:
        chosen = confident_views(logits, kept)
        logits, features = logits[chosen], features[chosen]
        loss = float(marginal_entropy(logits))
    else:
        loss = float(entropy(logits)[0])
    mean_logits = logits.mean(dim=0)
    return features.mean(dim=0), mean_logits, loss, logits.softmax(dim=-1).mean(dim=0), int(mean_logits.argmax())


class StreamCache:
    """The positive and negative caches of one test stream (module docstring); :meth:`step` takes the next image."""

    def __init__(self, n_classes: int, spec: CacheSpec = CacheSpec()):
        self.n_classes, self.spec = n_classes, spec
        self.positive, self.negative = ClassCache(spec.pos_capacity), ClassCache(spec.neg_capacity)

    def step(self, features: torch.Tensor, text: torch.Tensor, scale: float, kept: int) -> tuple[torch.Tensor, float]:
        """``(logits [C], entropy in nats)`` of the next image from its view features ``[V, E]`` at logit ``scale``,
        after the caches took it in."""
        s, n = self.spec, self.n_classes
        feature, logits, loss, probs, label = predict_one(features, text, scale, kept)
        one_hot = torch.zeros(n, dtype=logits.dtype, device=logits.device)
        one_hot[label] = 1.0
        self.positive.offer(label, feature, loss, one_hot)
        if s.neg_entropy[0] < loss / math.log2(n) < s.neg_entropy[1]:  # TDA's normalisation: nats over log2 C
            mask = ((probs > s.neg_mask[0]) & (probs < s.neg_mask[1])).to(logits.dtype)
            self.negative.offer(label, feature, loss, mask)
        out, weight = logits.clone(), scale / TDA_LOGIT_SCALE  # TDA's α against the model's own logit scale
        positive = self.positive.affinity_logits(feature, s.pos_beta)
        if positive is not None:
            out = out + weight * s.pos_alpha * positive
        negative = self.negative.affinity_logits(feature, s.neg_beta)
        if negative is not None:
            out = out - weight * s.neg_alpha * negative
        return out, loss


def stream_order(n: int, seed: int) -> torch.Tensor:
    """``[n]``: the seeded shuffle in which the images reach the caches (TDA shuffles its test loader)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))


@torch.no_grad()
def cache_and_predict(
    pclip,
    prompts,
    images: Sequence[torch.Tensor],
    classnames: Sequence[str],
    spec: TestTimeSpec = TestTimeSpec(adapt="cache"),
    seed: int = 0,
    progress: bool = False,
    cache: CacheSpec = CacheSpec(),
) -> TestTimeResult:
    """The caches over ``images`` (``[n, 3, H, W]`` or n ``[3, H, W]`` tensors) in :func:`stream_order` of ``seed``,
    classes ``classnames`` embedded with ``prompts`` (``None``: zero-shot CLIP's template; θ is never changed).
    ``spec.views`` and ``spec.kept`` say which views make an image's feature (image i's from
    :func:`meta.finetune.testtime.image_generator`); ``logits`` come back in the images' own order.  ``loss_before``
    is the mean entropy of the cache-free predictions, ``loss_after`` NaN (nothing is tuned)."""
    if len(images) == 0 or images[0].ndim != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else f"{len(images)} images"
        raise ValueError(f"test-time cache: expected unlabelled images [n >= 1, 3, H, W], got {shape}")
    text = pclip.text_features(prompts, classnames)  # [C, E]
    stream, scale = StreamCache(len(classnames), cache), float(pclip.logit_scale)
    rows: list[Optional[torch.Tensor]] = [None] * len(images)
    losses, peaks, t = [], [], time.perf_counter()
    order = stream_order(len(images), seed).tolist()
    for i in tqdm(order, desc="test-time cache", unit="img", leave=False, disable=not progress):
        image = images[i]

        def one() -> tuple[torch.Tensor, float]:
            views = view_batch(image, spec, image_generator(seed, i))
            return stream.step(pclip.image_features(prompts, views), text, scale, spec.kept)

        (rows[i], loss), mib = peak_mib(one)
        losses.append(loss)
        peaks.append(mib if image.device.type == "cpu" else None)
    return TestTimeResult(
        logits=torch.stack(rows),
        loss_before=sum(losses) / len(losses),
        loss_after=math.nan,
        seconds_per_image=(time.perf_counter() - t) / len(images),
        peak_mib_per_image=None if None in peaks else max(peaks),
    )
