"""The model a GRAM trainer registers with Dassl: learnable prompts θ over a frozen open_clip CLIP.

``GramCLIP.prompt_learner`` is θ (:class:`meta.method.prompts.PromptParams`, parameters ``ctx`` ``[M, d_t]``
and/or ``vpt`` ``[D, n, d_v]``): the only registered, saved and optimised module, so checkpoints
hold nothing class-dependent.  ``GramCLIP.clip`` is frozen and *stays in eval mode* whatever mode
the wrapper is switched to (Dassl's ``set_model_mode`` only reaches registered modules;
KaiyangZhou/Dassl.pytorch ``dassl/engine/trainer.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meta.method.consistency import ConsistencySpec, consistency_penalty, frozen_reference
from meta.method.learners import consistency_text, feature_logits, learner_of
from meta.method.prompts import DEFAULT_TEMPLATE, PromptedCLIP, PromptParams, visual_prompts
from meta.model.backbone import ClipDims


class GramCLIP(nn.Module):
    """Classify images into ``classnames`` with prompted CLIP: ``forward(images [B,3,H,W]) -> logits [B, C]``."""

    def __init__(
        self,
        clip: nn.Module,
        dims: ClipDims,
        prompts: PromptParams,
        classnames: Sequence[str],
        template: str = DEFAULT_TEMPLATE,
        consistency: Optional[ConsistencySpec] = None,
    ):
        super().__init__()
        if len(classnames) == 0:
            raise ValueError("GramCLIP needs at least one class name")
        self.prompt_learner = prompts
        self.clip = clip
        for p in self.clip.parameters():
            p.requires_grad_(False)
        self.dims = dims
        self.classnames = list(classnames)
        self.pclip = PromptedCLIP(clip, dims, prompts.n_ctx_text, template=template)
        self._text_cache: Optional[torch.Tensor] = None
        self.clip.eval()
        # zero-shot consistency (meta.method.consistency): the frozen references of its terms, when a weight is > 0
        self.consistency = consistency if consistency is not None and consistency.active else None
        self._reference = frozen_reference(clip, DEFAULT_TEMPLATE) if self.consistency is not None else None

    def train(self, mode: bool = True) -> "GramCLIP":
        super().train(mode)
        self.clip.eval()  # frozen CLIP: never in train mode
        return self

    def text_features(self) -> torch.Tensor:
        """``[C, E]`` normalised class embeddings for the current θ (refused for a learner whose text depends on
        each image: :attr:`meta.method.learners.PromptLearner.per_image_text`)."""
        return self.pclip.text_features(self.prompt_learner, self.classnames)

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the frozen CLIP (fp16 under PREC fp16); θ itself stays fp32."""
        return self.clip.visual.conv1.weight.dtype

    def _features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(images in the CLIP's dtype, image features [B, E], text features [C, E] or per image [B, C, E])`` for
        the current θ, by its learner (:meth:`meta.method.learners.PromptLearner.features`)."""
        images = images.to(self.dtype)
        image, text = learner_of(self.prompt_learner).features(self.pclip, self.prompt_learner, self.classnames, images)
        return images, image, text.to(image.dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        _, image, text = self._features(images)
        return feature_logits(self.pclip.logit_scale, image, text)

    def training_loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, logits [B, C] fp32)``: cross-entropy, plus the zero-shot consistency terms when they are on
        (the same functions as the evaluator's :func:`meta.method.prompts.classification_loss`)."""
        loss, penalty, logits = self.training_loss_parts(images, labels)
        return (loss if penalty is None else loss + penalty), logits

    def training_loss_parts(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(cross-entropy, consistency penalty or None when off, logits [B, C] fp32)`` from one forward: the
        gate form of R_φ needs the two gradients apart.  Per-image text features enter the text term as the mean
        over images (:func:`meta.method.learners.consistency_text`)."""
        images, image, text = self._features(images)
        logits = feature_logits(self.pclip.logit_scale, image, text).float()
        loss = F.cross_entropy(logits, labels)
        penalty = None
        if self.consistency is not None:
            has_visual = visual_prompts(self.prompt_learner) is not None
            text, names = consistency_text(text, self.classnames)
            penalty = consistency_penalty(self.consistency, self._reference, names, text, image, images, has_visual)
        return loss, penalty, logits

    # ---------------------------------------------------------------- inference with cached text side
    def reset_cache(self) -> None:
        """Forget cached text features (call whenever θ may have changed)."""
        self._text_cache = None

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """``forward`` without gradients, computing the text side once until :meth:`reset_cache` (every batch for a
        learner whose text depends on each image)."""
        learner = learner_of(self.prompt_learner)
        if learner.per_image_text:
            return self.forward(images)
        if self._text_cache is None:
            self._text_cache = self.text_features()
        image = learner.image_features(self.pclip, self.prompt_learner, images.to(self.dtype))
        return feature_logits(self.pclip.logit_scale, image, self._text_cache.to(image.dtype))
