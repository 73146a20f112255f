"""Tensor plumbing shared by pretraining and zero-shot evaluation of the tiny world CLIP.

Images go into the model exactly as open_clip's eval transform would feed a
32-px file (resize and centre-crop are identities at the native side):
``ToTensor`` then ``Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)`` -
the same mean/std CoOp's Dassl configs use for CLIP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torch import nn

from meta.method.prompts import DEFAULT_TEMPLATE
from meta.model.text_encoder import text_head

WORLD_MODEL = "GRAM-World-ViT-T"

_MEAN = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
_STD = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)


def to_model_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, S, S, 3]`` (or ``[B, 3, S, S]``) -> normalised float ``[B, 3, S, S]``."""
    if images.dim() != 4:
        raise ValueError(f"expected a batch of images [B,S,S,3] or [B,3,S,S], got shape {tuple(images.shape)}")
    if images.shape[-1] == 3:
        images = images.permute(0, 3, 1, 2)
    x = images.float().div_(255.0)
    return (x - _MEAN) / _STD


def load_images(paths: Sequence[Path]) -> torch.Tensor:
    """Read image files into one uint8 tensor ``[N, S, S, 3]`` (all must share a side)."""
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    sides = {a.shape for a in arrays}
    if len(sides) > 1:
        raise ValueError(f"images have different shapes {sorted(sides)}; the world writes one side only")
    return torch.from_numpy(np.stack(arrays))


def encode_text_trimmed(
    clip: nn.Module, tokens: torch.Tensor, embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
) -> torch.Tensor:
    """``clip.encode_text`` on tokens cut after the longest end-of-text position.

    CLIP's text transformer is causal and pools the end-of-text token, so the
    padding after it cannot change the result; dropping it makes pretraining
    several times cheaper.  ``tokens``: ``[B, 77]`` int -> features ``[B, embed_dim]``
    (unnormalised).  A test checks equality with ``clip.encode_text``.
    ``embed`` (default ``clip.token_embedding``) maps the trimmed ids ``[B, L]`` to ``[B, L, width]``.
    """
    eot_pos = tokens.argmax(dim=-1)  # EOT has the largest id in CLIP's vocabulary
    length = int(eot_pos.max()) + 1
    t = tokens[:, :length]
    cast = clip.transformer.get_cast_dtype()
    x = (embed or clip.token_embedding)(t).to(cast) + clip.positional_embedding[:length].to(cast)
    x = clip.transformer(x, attn_mask=clip.attn_mask[:length, :length])
    return text_head(clip, x[torch.arange(x.shape[0]), eot_pos])


@torch.no_grad()
def class_text_features(
    clip: nn.Module, tokenizer, classnames: Sequence[str], template: str = DEFAULT_TEMPLATE
) -> torch.Tensor:
    """L2-normalised text features ``[C, embed_dim]`` of one prompt per class."""
    tokens = tokenizer([template.format(c) for c in classnames])
    return F.normalize(clip.encode_text(tokens), dim=-1)


@torch.no_grad()
def image_features(clip: nn.Module, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """L2-normalised image features ``[N, embed_dim]`` of uint8 images ``[N, S, S, 3]``."""
    out = [
        F.normalize(clip.encode_image(to_model_input(images[i : i + batch_size])), dim=-1)
        for i in range(0, len(images), batch_size)
    ]
    return torch.cat(out)
