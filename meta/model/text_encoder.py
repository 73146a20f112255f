"""CoOp-style text prompts run through a frozen open_clip text tower.

A prompt for class ``c`` is ``[SOT] t_1 ... t_M <tokens of c> . [EOT] [PAD]...`` where ``t_1..t_M`` are learnable
context vectors (Zhou et al., CoOp, IJCV 2022, Eq. 2 of the GRAM paper).  The token embeddings of everything but the
context are computed once per class name and cached (:class:`ClassTokenCache`).

Exact truncation: the causal mask and EOT pooling mean no token after the EOT changes the feature, so a batch needs
only the first ``max(eot) + 1`` positions instead of 77.  Deep text prompts (IVLP / MaPLe, ``ctx_deep``
``[J-1, M, d_t]``): before block ``i`` (``1 <= i < J``) positions ``1..M`` are replaced by ``ctx_deep[i-1]``, no
positional embedding added (multimodal-prompt-learning ``clip/model.py``); they lie before every EOT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import open_clip
import torch
from torch import nn

from meta.model.blocks import block_forward, transformer_forward
from meta.model.layer_norm import apply_norm

_PLACEHOLDER = "X"  # one BPE token; its embedding is replaced by the context vectors


@dataclass
class ClassTokens:
    """Frozen token embeddings for a list of classes, with room for M context vectors.

    Attributes:
        prefix: ``[C, 1, d_t]`` embedding of the start token.
        suffix: ``[C, T - 1 - M, d_t]`` embeddings of class-name tokens, ``.``, EOT (and padding up to T).
        eot_index: ``[C]`` position of the EOT token in the assembled sequence of length T.
        n_ctx: M, the number of context slots between prefix and suffix.
        positional: ``[T, d_t]`` the CLIP's positional embedding for these T positions, or ``None`` (then
            :func:`encode_text_with_context` slices and casts ``clip.positional_embedding`` itself).

    :class:`ClassTokenCache` keeps prefix, suffix and positional in the text blocks' dtype
    (:func:`tower_dtype`), so a step casts nothing.
    """

    prefix: torch.Tensor
    suffix: torch.Tensor
    eot_index: torch.Tensor
    n_ctx: int
    positional: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        """T, the number of token positions the text transformer runs over."""
        return 1 + self.n_ctx + self.suffix.shape[1]

    def __len__(self) -> int:
        return self.prefix.shape[0]


class ClassTokenCache:
    """Per-class-name cache of frozen token embeddings for a fixed context length M.

    Class names are tokenised once (``"X X X X <name>."``, CoOp's recipe) and their
    embeddings kept at full context length, in the text blocks' dtype; :meth:`tokens` stacks the
    requested classes and truncates them to ``max(eot) + 1`` positions when ``truncate``.  The last
    :attr:`STACKED` distinct class lists are kept stacked (a fine-tuning run asks for the same list every
    step: no stack, no host-to-device copy of the EOT positions).  The CLIP is frozen: its embeddings are read once.
    """

    STACKED = 8

    def __init__(self, clip: nn.Module, n_ctx: int, template: str = "{}.", truncate: bool = True):
        self.clip = clip
        self.n_ctx = n_ctx
        self.template = template
        self.truncate = truncate
        self.tokenizer = open_clip.get_tokenizer("ViT-B-16")  # OpenAI BPE, shared by all CLIP text towers here
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._stacked: dict[tuple[str, ...], ClassTokens] = {}
        self._positional: Optional[torch.Tensor] = None

    def _encode_names(self, names: Sequence[str]) -> None:
        missing = [n for n in dict.fromkeys(names) if n not in self._cache]
        if not missing:
            return
        ctx_words = " ".join([_PLACEHOLDER] * self.n_ctx)
        texts = [(ctx_words + " " if self.n_ctx else "") + self.template.format(n.replace("_", " ")) for n in missing]
        context_length = self.clip.positional_embedding.shape[0]
        tokens = self.tokenizer(texts, context_length=context_length).to(self.clip.token_embedding.weight.device)
        eot = tokens.argmax(dim=-1)  # EOT has the largest id in CLIP's vocabulary
        if bool((eot >= context_length - 1).any()):
            too_long = [n for n, e in zip(missing, eot.tolist()) if e >= context_length - 1]
            raise ValueError(
                f"class names too long for {context_length} text tokens with {self.n_ctx} "
                f"context tokens: {too_long[:3]}"
            )
        with torch.no_grad():  # cast once to the blocks' dtype (open_clip's fp16 keeps embeddings fp32)
            emb = self.clip.token_embedding(tokens).to(tower_dtype(self.clip.transformer))  # [n, 77, d_t]
        for i, name in enumerate(missing):
            self._cache[name] = (emb[i, :1], emb[i, 1 + self.n_ctx :], int(eot[i]))

    def tokens(self, classnames: Sequence[str]) -> ClassTokens:
        """Stacked frozen embeddings for ``classnames`` (order kept): see :class:`ClassTokens`."""
        if len(classnames) == 0:
            raise ValueError("need at least one class name")
        key = tuple(classnames)
        hit = self._stacked.get(key)
        if hit is not None:
            return hit
        self._encode_names(classnames)
        entries = [self._cache[n] for n in classnames]
        eots = [e[2] for e in entries]
        full = entries[0][1].shape[0] + 1 + self.n_ctx
        length = max(eots) + 1 if self.truncate else full  # from the host list: no device sync
        n_suffix = length - 1 - self.n_ctx
        prefix = torch.stack([e[0] for e in entries])
        suffix = torch.stack([e[1][:n_suffix] for e in entries])
        if self._positional is None:
            self._positional = self.clip.positional_embedding.detach().to(prefix.dtype)
        out = ClassTokens(
            prefix=prefix,
            suffix=suffix,
            eot_index=torch.tensor(eots, device=prefix.device),
            n_ctx=self.n_ctx,
            positional=self._positional[:length],
        )
        if len(self._stacked) >= self.STACKED:
            self._stacked.pop(next(iter(self._stacked)))  # the oldest list
        self._stacked[key] = out
        return out


def tower_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype a transformer's blocks compute in (open_clip's ``get_cast_dtype``: its first MLP weight).

    open_clip's fp16 weights (``precision="fp16"``) convert linear and attention weights only; token and
    position embeddings stay fp32, so a sequence built from them must be cast to this dtype first.
    """
    if hasattr(transformer, "get_cast_dtype"):
        return transformer.get_cast_dtype()
    return next(p for p in transformer.parameters() if p.dim() > 1).dtype


def encode_text_with_context(
    clip: nn.Module, tokens: ClassTokens, ctx: Optional[torch.Tensor], ctx_deep: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``[C, E]`` text features (not normalised, differentiable w.r.t. ``ctx``) of the frozen text tower ``clip`` on
    ``[SOT, ctx, class tokens]`` for the C classes of ``tokens`` (``tokens.n_ctx`` must equal M).

    ``ctx``: ``[M, d_t]`` shared or ``[C, M, d_t]`` per class; ``None`` when M = 0.  ``ctx_deep``: ``[J-1, M, d_t]``
    deep prompts that replace the context positions' hidden states before blocks ``1..J-1``, or ``[C, J-1, M, d_t]``
    per class (task-stacked sequences); ``None`` = shallow (CoOp).
    """
    n_cls = len(tokens)
    dtype = tower_dtype(clip.transformer)  # fp16 under open_clip's fp16 weights; embeddings stay fp32 there
    parts = [tokens.prefix.to(dtype)]
    if tokens.n_ctx:
        if ctx is None:
            raise ValueError(f"class tokens were built for {tokens.n_ctx} context vectors but ctx is None")
        if ctx.shape[-2] != tokens.n_ctx:
            raise ValueError(f"ctx has {ctx.shape[-2]} vectors, class tokens expect {tokens.n_ctx}")
        if ctx.dim() == 2:
            ctx = ctx.unsqueeze(0).expand(n_cls, -1, -1)
        parts.append(ctx.to(dtype))
    parts.append(tokens.suffix.to(dtype))
    x = torch.cat(parts, dim=1)  # [C, T, d_t]
    length = x.shape[1]
    pos = tokens.positional if tokens.positional is not None else clip.positional_embedding[:length]
    x = x + pos.to(x.dtype)
    mask = clip.attn_mask[:length, :length] if clip.attn_mask is not None else None
    if ctx_deep is not None and ctx_deep.dim() == 4:  # per class: [C, J-1, M, d_t] -> layer-major [J-1, C, M, d_t]
        if ctx_deep.shape[0] != n_cls:
            raise ValueError(f"per-class ctx_deep must be [C={n_cls}, J-1, M, d_t], got {tuple(ctx_deep.shape)}")
        ctx_deep = ctx_deep.transpose(0, 1)
    if ctx_deep is None or ctx_deep.shape[0] == 0:
        # only the EOT outputs of the last block are read (meta.model.blocks: exact, skips the other rows' MLP)
        x = transformer_forward(clip.transformer, x, attn_mask=mask, last_rows=tokens.eot_index)  # [C, 1, d_t]
        return text_head(clip, x[:, 0])
    blocks = clip.transformer.resblocks
    m = tokens.n_ctx
    if ctx_deep.dim() not in (3, 4) or ctx_deep.shape[-2] != m or ctx_deep.shape[0] >= len(blocks):
        raise ValueError(f"ctx_deep must be [J-1 < {len(blocks)}, {m}, d_t], got {tuple(ctx_deep.shape)}")
    deep = ctx_deep.to(x.dtype)
    for i in range(1, 1 + deep.shape[0]):
        x = block_forward(blocks[i - 1], x, mask)
        layer = deep[i - 1] if deep.dim() == 4 else deep[i - 1].unsqueeze(0).expand(n_cls, -1, -1)  # [C, M, d_t]
        x = torch.cat([x[:, :1], layer, x[:, 1 + m :]], dim=1)
    x = transformer_forward(
        clip.transformer, x, attn_mask=mask, last_rows=tokens.eot_index, start=deep.shape[0]
    )  # [C, 1, d_t]
    return text_head(clip, x[:, 0])


def text_head(clip: nn.Module, pooled: torch.Tensor) -> torch.Tensor:
    """CLIP's text head on the pooled (EOT) outputs of the text transformer: ``ln_final`` then the projection.

    ``pooled``: ``[C, d_t]`` -> ``[C, E]`` (not normalised).  ``ln_final`` acts per row, so applying it
    to the pooled rows only gives the same numbers as open_clip, which normalises every position first.
    """
    x = apply_norm(clip.ln_final, pooled)
    proj = clip.text_projection
    return proj(x) if isinstance(proj, nn.Linear) else x @ proj


def context_from_words(clip: nn.Module, words: str) -> torch.Tensor:
    """Embeddings ``[M, d_t]`` of the BPE tokens of ``words`` (e.g. "a photo of a" gives M = 4)."""
    tokenizer = open_clip.get_tokenizer("ViT-B-16")
    tokens = tokenizer([words.replace("_", " ")], context_length=clip.positional_embedding.shape[0])
    n = int(tokens.argmax(dim=-1)) - 1
    if n <= 0:
        raise ValueError(f"context init {words!r} has no tokens")
    with torch.no_grad():
        emb = clip.token_embedding(tokens.to(clip.token_embedding.weight.device))
    return emb[0, 1 : 1 + n].clone()
