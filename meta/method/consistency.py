"""Zero-shot consistency: a fine-tuning regulariser that keeps prompted CLIP's features near frozen CLIP's.

Two terms, each with its own weight λ (:class:`ConsistencySpec`; both 0 = off, the plain cross-entropy):

* **text** (KgCoOp, Yao et al. CVPR 2023; htyao89/KgCoOp ``trainers/kgcoop.py``): with ``w_k`` the prompted
  class text feature and ``w_k⁰`` the frozen CLIP's feature of the hand-made prompt ``"a photo of a {}."``,
  both L2-normalised, ``L_text = 1 − (1/K) Σ_k cos(w_k, w_k⁰)``.  KgCoOp's base-to-new scripts use λ = 8.
* **image** (PromptSRC, Khattak et al. ICCV 2023; muzairkhattak/PromptSRC ``trainers/promptsrc.py``): with
  ``f_i`` the prompted image feature and ``f_i⁰`` the frozen tower's feature of the same image, both
  L2-normalised, ``L_image = mean_{i,e} |f_ie − f_ie⁰|`` (an L1 loss over the ``[n, E]`` entries).  PromptSRC's
  config uses λ = 10.  Without visual prompts ``f = f⁰`` and the term is 0.

The loss is ``CE + λ_text · L_text + λ_image · L_image``; the frozen references carry no gradient.  The evaluator
(:func:`meta.method.prompts.classification_loss`) and the Dassl trainers (``trainers/gram``) compute it with the same
functions, so the engine agreement test covers it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ConsistencySpec:
    """Weights of the two zero-shot consistency terms (dimensionless; 0 = the term is off)."""

    text_weight: float = 0.0
    image_weight: float = 0.0

    def __post_init__(self) -> None:
        for name in ("text_weight", "image_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"consistency {name}: expected a finite number >= 0, got {value!r}")

    @property
    def active(self) -> bool:
        return self.text_weight > 0 or self.image_weight > 0


def text_consistency(prompted: torch.Tensor, zero_shot: torch.Tensor) -> torch.Tensor:
    """``1 − mean_k cos(prompted_k, zero_shot_k)`` for L2-normalised ``[K, E]`` features (0-d tensor)."""
    if prompted.shape != zero_shot.shape:
        raise ValueError(f"text features {tuple(prompted.shape)} vs zero-shot {tuple(zero_shot.shape)}")
    return 1.0 - (prompted * zero_shot.to(prompted.dtype)).sum(dim=-1).mean()


def image_consistency(prompted: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of L2-normalised ``[n, E]`` image features (0-d tensor)."""
    if prompted.shape != frozen.shape:
        raise ValueError(f"image features {tuple(prompted.shape)} vs frozen {tuple(frozen.shape)}")
    return F.l1_loss(prompted, frozen.to(prompted.dtype), reduction="mean")


class ZeroShotReference:
    """The frozen CLIP's side of both terms: hand-made-prompt text features (cached per class name) and the
    image tower's features without prompts, from the open_clip ``clip`` with the hand-made ``template``; no
    gradient flows into either.  Nothing is encoded before the first :meth:`text` / :meth:`image` call."""

    def __init__(self, clip: nn.Module, template: str):
        self._clip = clip
        self._template = template
        self._tokens = None  # meta.model.text_encoder.ClassTokenCache, made on first use
        self._text: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def text(self, classnames: Sequence[str]) -> torch.Tensor:
        """``[K, E]`` normalised features of ``"a photo of a {name}."`` per class."""
        from meta.model.text_encoder import ClassTokenCache, encode_text_with_context

        missing = [c for c in dict.fromkeys(classnames) if c not in self._text]
        if missing:
            if self._tokens is None:
                self._tokens = ClassTokenCache(self._clip, 0, template=self._template)
            feats = encode_text_with_context(self._clip, self._tokens.tokens(missing), None)
            self._text.update(zip(missing, F.normalize(feats.float(), dim=-1)))
        return torch.stack([self._text[c] for c in classnames])

    @torch.no_grad()
    def image(self, images: torch.Tensor) -> torch.Tensor:
        """``[n, E]`` normalised frozen image features (no prompts)."""
        from meta.model.visual_encoder import encode_image_with_prompts

        return F.normalize(encode_image_with_prompts(self._clip, images, None).float(), dim=-1)


def consistency_penalty(
    spec: ConsistencySpec,
    reference: ZeroShotReference,
    classnames: Sequence[str],
    text_features: torch.Tensor,
    image_features: torch.Tensor,
    images: torch.Tensor | None,
    visual_prompts: bool,
) -> torch.Tensor:
    """``λ_text · L_text + λ_image · L_image`` (0-d): ``text_features`` ``[K, E]`` and ``image_features`` ``[n, E]`` are
    the prompted ones (normalised); ``images`` ``[n, 3, H, W]`` feed the frozen tower when the learner has
    ``visual_prompts`` (otherwise the image term is 0 and no extra forward runs)."""
    total = text_features.new_zeros(())
    if spec.text_weight > 0:
        total = total + spec.text_weight * text_consistency(text_features.float(), reference.text(classnames))
    if spec.image_weight > 0 and visual_prompts:
        if images is None:
            raise ValueError("the image consistency term needs the images (cached features carry no visual prompts)")
        frozen = reference.image(images)
        total = total + spec.image_weight * image_consistency(image_features.float(), frozen)
    return total


def frozen_reference(clip: nn.Module, template: str) -> ZeroShotReference:
    """A :class:`ZeroShotReference` of an open_clip ``clip`` with the hand-made ``template``."""
    return ZeroShotReference(clip, template)
