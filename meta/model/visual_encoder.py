"""Visual prompt tokens (VPT, Jia et al. ECCV 2022) run through a frozen open_clip ViT.

We do not patch open_clip: our own forward runs the frozen ViT's submodules and inserts the prompt tokens between
them.  Layout (MaPLe's IVLP/VPT code, multimodal-prompt-learning ``clip/model.py``; reference section 7):

* shallow (depth 1): ``n`` prompt tokens are appended after the CLS and patch tokens (after the positional embedding,
  before ``ln_pre``) and travel through every block;
* deep (depth D > 1): before block ``i`` (``1 <= i < D``) the outputs at the
  prompt positions are replaced by that layer's fresh prompt tokens.

The pooled output still comes from the CLS token: with no prompts this equals ``clip.encode_image``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from meta.model.blocks import block_forward
from meta.model.layer_norm import apply_norm, closed_form_active


def _check_supported(visual: nn.Module) -> None:
    if getattr(visual, "attn_pool", None) is not None:
        raise NotImplementedError("visual prompts need a plain CLS-pooled ViT; this tower uses attentional pooling")
    if getattr(visual, "final_ln_after_pool", False):
        raise NotImplementedError("visual prompts need ln_post before pooling (final_ln_after_pool=False)")
    if getattr(visual, "pool_type", "tok") != "tok":
        raise NotImplementedError(f"visual prompts need CLS-token pooling, tower uses {visual.pool_type!r}")


def _ln_pre(ln: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``ln(x)``; under autocast, in float32 with autocast off and the float32 result kept.

    The shallow prompt tokens enter ``ln_pre`` with a small spread (N(0, 0.02²) or the patch-mean token), so its inverse
    standard deviation is large.  Under fp16 autocast, open_clip's LayerNorm (float32 inside, output cast back to fp16)
    gave NaN in ``NativeLayerNormBackwardBackward0``, the double backward the second-order meta-gradient takes through
    it (UNIGRAM, ViT-B/16, CPU; the tiny test CLIP with prompts of std <= 0.02): ``tests/test_precision.py``.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type) or not isinstance(ln, nn.LayerNorm):
        return apply_norm(ln, x)
    if closed_form_active(ln):  # the same float32 norm, with the closed-form double backward (meta.model.layer_norm)
        return apply_norm(ln, x, out_dtype=torch.float32)
    with torch.autocast(device_type=device_type, enabled=False):
        weight = None if ln.weight is None else ln.weight.float()
        bias = None if ln.bias is None else ln.bias.float()
        return F.layer_norm(x.float(), ln.normalized_shape, weight, bias, ln.eps)


def encode_image_with_prompts(
    clip: nn.Module, images: torch.Tensor, vpt: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``[B, E]`` image features (not normalised) of ``images`` ``[B, 3, H, W]`` (normalised pixels) from the frozen
    ViT of ``clip`` with prompt tokens ``vpt``: ``[D, n, d_v]`` (``D == 1`` shallow VPT, ``D > 1`` deep: layer
    ``i < D`` gets ``vpt[i]``), or ``[G, D, n, d_v]`` for G groups of prompts (the tasks of :mod:`meta.method.batched`:
    the images in G equal consecutive groups, group g seeing ``vpt[g]``); ``None`` or ``n == 0`` runs the plain tower.
    """
    visual = clip.visual
    if vpt is None or vpt.shape[-2] == 0:
        return visual(images)
    _check_supported(visual)
    depth, n_prompt, _ = vpt.shape[-3:]
    n_layers = len(visual.transformer.resblocks)
    if depth > n_layers:
        raise ValueError(f"vpt has {depth} prompt layers but the vision tower has {n_layers} blocks")
    batch = images.shape[0]
    if vpt.dim() == 4 and batch % vpt.shape[0]:
        raise ValueError(f"{batch} images do not split into {vpt.shape[0]} equal groups of prompts")

    def layer(i: int) -> torch.Tensor:
        """``[batch, n, d_v]``: layer i's tokens for every image."""
        if prompts.dim() == 3:
            return prompts[i].unsqueeze(0).expand(batch, -1, -1)
        return prompts[:, i].repeat_interleave(batch // prompts.shape[0], dim=0)

    x = visual.conv1(images.to(visual.conv1.weight.dtype))  # [B, d_v, g, g]
    x = x.reshape(batch, x.shape[1], -1).permute(0, 2, 1)  # [B, g*g, d_v]
    cls = visual.class_embedding.to(x.dtype).view(1, 1, -1).expand(batch, -1, -1)
    x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)  # [B, 1+g*g, d_v]
    prompts = vpt.to(x.dtype)
    x = torch.cat([x, layer(0)], dim=1)  # [B, 1+g*g+n, d_v]
    x = _ln_pre(visual.ln_pre, x)
    n_keep = x.shape[1] - n_prompt
    blocks = visual.transformer.resblocks
    cls_row = torch.zeros(batch, dtype=torch.long, device=x.device)
    for i in range(n_layers):
        if 0 < i < depth:
            x = torch.cat([x[:, :n_keep], layer(i)], dim=1)
        # the last block computes the CLS output only (the only one pooled; meta.model.blocks)
        x = block_forward(blocks[i], x, rows=cls_row if i == n_layers - 1 else None)
    pooled = apply_norm(visual.ln_post, x[:, 0])
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    return pooled
