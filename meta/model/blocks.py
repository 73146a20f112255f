"""Our own forward through a frozen open_clip residual attention block.

open_clip's ``nn.MultiheadAttention`` with ``batch_first=True`` transposes its input to ``[L, N, E]``, and every
backward and double backward pays for the transposes and copies.  :func:`block_forward` computes the same function from
the block's frozen weights in ``[N, L, E]`` layout (each projection one matrix product) through
``F.scaled_dot_product_attention`` (honouring ``sdpa_kernel`` contexts); measured in docs/benchmark.md.  ``rows``
computes the output of selected positions only (EOT or CLS; every position still serves as key and value, so they are
exact).  Blocks we do not recognise fall back to their own ``forward`` (``rows`` then selects after the block).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from meta.model.layer_norm import apply_norm


def is_plain_block(block: nn.Module) -> bool:
    """Whether :func:`block_forward` can run ``block`` from its weights (open_clip's default block)."""
    attn = getattr(block, "attn", None)
    return (
        isinstance(attn, nn.MultiheadAttention)
        and attn._qkv_same_embed_dim
        and attn.in_proj_bias is not None
        and attn.batch_first
        and not hasattr(block, "ln_1_kv")
        and isinstance(getattr(block, "ln_attn", nn.Identity()), nn.Identity)
        and all(hasattr(block, name) for name in ("ln_1", "ln_2", "mlp", "ls_1", "ls_2"))
    )


def _select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[n, rows[n]]`` kept as ``[N, 1, E]``."""
    return x[torch.arange(x.shape[0], device=x.device), rows].unsqueeze(1)


def block_forward(
    block: nn.Module, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Output ``[N, L, E]`` of one open_clip ``ResidualAttentionBlock`` (frozen or not) on batch-first tokens ``x``
    ``[N, L, E]`` with an additive float ``attn_mask`` ``[L, L]`` (``-inf`` = blocked) or ``None``; with ``rows``
    (``[N]`` long positions) only those positions' outputs are computed: ``[N, 1, E]``."""
    if not is_plain_block(block):
        attn = getattr(block, "attn", None)
        if not isinstance(attn, nn.MultiheadAttention) or attn.batch_first:
            out = block(x, attn_mask=attn_mask)
        else:  # an old sequence-first block
            out = block(x.transpose(0, 1), attn_mask=attn_mask).transpose(0, 1)
        return out if rows is None else _select_rows(out, rows)
    n, length, width = x.shape
    attn = block.attn
    heads = attn.num_heads
    y = apply_norm(block.ln_1, x)
    if rows is None:
        qkv = F.linear(y, attn.in_proj_weight, attn.in_proj_bias)  # [N, L, 3E]
        q, k, v = qkv.view(n, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)  # each [N, H, L, hd]
        mask, residual = attn_mask, x
    else:
        w, b = attn.in_proj_weight, attn.in_proj_bias  # rows [q; k; v]
        kv = F.linear(y, w[width:], b[width:]).view(n, length, 2, heads, width // heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]  # [N, H, L, hd]
        q = F.linear(_select_rows(y, rows), w[:width], b[:width]).view(n, 1, heads, width // heads).transpose(1, 2)
        mask = attn_mask[rows].unsqueeze(1).unsqueeze(1) if attn_mask is not None else None  # [N, 1, 1, L]
        residual = _select_rows(x, rows)
    if mask is not None:
        mask = mask.to(q.dtype)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [N, H, Lq, hd]
    a = a.transpose(1, 2).reshape(n, q.shape[2], width)
    x = residual + block.ls_1(attn.out_proj(a))
    return x + block.ls_2(block.mlp(apply_norm(block.ln_2, x)))


def transformer_forward(
    transformer: nn.Module,
    x: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    last_rows: Optional[torch.Tensor] = None,
    start: int = 0,
) -> torch.Tensor:
    """Run blocks ``start..end`` of an open_clip ``Transformer`` on batch-first ``[N, L, E]`` tokens.

    With ``last_rows`` (``[N]`` positions) the last block returns only those positions: ``[N, 1, E]``.
    """
    blocks = transformer.resblocks
    for i in range(start, len(blocks)):
        x = block_forward(blocks[i], x, attn_mask, last_rows if i == len(blocks) - 1 else None)
    return x
