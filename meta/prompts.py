"""Learnable prompts θ and the prompted (frozen) CLIP that consumes them.

θ lives in one small module, :class:`PromptParams`, holding at most two tensors:

* ``ctx``: ``[M, d_t]`` text context vectors (CoOp), present when ``n_ctx_text > 0``;
* ``vpt``: ``[D, n, d_v]`` visual prompt tokens (VPT), present when ``n_ctx_vision > 0``
  (``D = 1`` shallow, ``D > 1`` deep).

The frozen CLIP is *not* a submodule of it; :class:`PromptedCLIP` holds the CLIP
and takes the prompt module at call time.  That is what lets learn2learn's
``GBML`` clone only θ per task (never the CLIP weights).

Methods: CoOp = text only; VPT = vision only, text side the fixed prompt
``"a photo of a {}."`` (paper's VPT baseline); UNIGRAM = both (paper: 2 + 2).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .backbone import ClipDims
from .text_encoder import ClassTokenCache, context_from_words, encode_text_with_context
from .visual_encoder import encode_image_with_prompts


# CoOp's hand-made prompt: zero-shot CLIP's text and the fixed text side of VPT (CoOp paper, section 4.1).
DEFAULT_TEMPLATE = "a photo of a {}."

# Initialisations of the visual prompt tokens (PromptSpec.vpt_init).
VPT_INITS = ("normal", "zeros", "cls", "patch_mean")


@torch.no_grad()
def initial_visual_prompts(clip: nn.Module, how: str, depth: int, n: int, init_std: float,
                           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``[depth, n, d_v]`` initial visual prompt tokens (float32, on the CPU).

    The shallow tokens (layer 0) live where :func:`meta.visual_encoder.encode_image_with_prompts`
    appends them: after the positional embedding, before ``ln_pre``, which rescales every token to
    unit variance.  A random token therefore enters the tower at full scale whatever ``init_std``
    is.  The other rules start from a token built from the frozen tower (no data):

    * ``normal``: N(0, init_std²) (CoOp's context init; MaPLe's VPT / IVLP prompts);
    * ``zeros``: all zero; ``ln_pre`` maps it to its bias (deterministic; the n tokens stay equal
      under any gradient step, so they act as one);
    * ``cls``: the CLS input token (``class_embedding + positional_embedding[0]``) plus
      N(0, init_std²) so the tokens differ;
    * ``patch_mean``: the mean of the patch positional embeddings (plus ``conv1``'s bias when it
      has one), i.e. a patch of no content at no particular place, plus N(0, init_std²).

    Deep layers (``1 <= i < depth``) replace hidden states after ``ln_pre``, so for the rules other
    than ``normal`` they start from ``ln_pre`` of the layer-0 base token (plus the same noise).
    """
    if how not in VPT_INITS:
        raise ValueError(f"vpt_init must be one of {', '.join(VPT_INITS)}, got {how!r}")
    visual = clip.visual
    width = visual.conv1.weight.shape[0]
    noise = torch.randn(depth, n, width, generator=generator) * init_std
    if how == "normal":
        return noise
    pos = visual.positional_embedding.detach().float().cpu()              # [1 + g*g, d_v]
    if how == "zeros":
        base = torch.zeros(width)
        noise = torch.zeros_like(noise)
    elif how == "cls":
        base = visual.class_embedding.detach().float().cpu() + pos[0]
    else:
        base = pos[1:].mean(dim=0)
        if visual.conv1.bias is not None:
            base = base + visual.conv1.bias.detach().float().cpu()
    ref = visual.conv1.weight
    deep = visual.ln_pre(base.to(ref.device, ref.dtype)).float().cpu()
    bases = torch.stack([base] + [deep] * (depth - 1)).unsqueeze(1)          # [depth, 1, d_v]
    return bases + noise


@dataclass
class PromptSpec:
    """Shape and initialisation of θ.

    Attributes:
        n_ctx_text: M, text context vectors (0 = no text prompts; the text side then
            uses ``template``).  Ignored when ``ctx_init`` is set (M = its token count).
        ctx_init: words to initialise the context from (e.g. "a photo of a"); "" = N(0, init_std²).
        n_ctx_vision: n, visual prompt tokens per prompted layer (0 = none).
        vision_depth: D, layers that receive visual prompts (1 = shallow VPT).
        init_std: standard deviation of random prompt initialisation (CoOp uses 0.02).
        template: fixed text prompt when there is no text context.
        vpt_init: how the visual tokens start (:data:`VPT_INITS`, :func:`initial_visual_prompts`):
            ``normal`` = N(0, init_std²) (CoOp / MaPLe); ``zeros``; ``cls`` = the frozen CLS input
            token + N(0, init_std²); ``patch_mean`` = the mean patch position code + N(0, init_std²).
    """

    n_ctx_text: int = 4
    ctx_init: str = ""
    n_ctx_vision: int = 0
    vision_depth: int = 1
    init_std: float = 0.02
    template: str = DEFAULT_TEMPLATE
    vpt_init: str = "patch_mean"   # chosen on the val splits (docs/world_baseline.md)

    def __post_init__(self) -> None:
        if self.vpt_init not in VPT_INITS:
            raise ValueError(f"vpt_init must be one of {', '.join(VPT_INITS)}, got {self.vpt_init!r}")

    def as_dict(self) -> dict:
        return asdict(self)


class PromptParams(nn.Module):
    """θ: the learnable prompt tensors (see module docstring for shapes)."""

    def __init__(self, ctx: Optional[torch.Tensor] = None, vpt: Optional[torch.Tensor] = None):
        super().__init__()
        if ctx is None and vpt is None:
            raise ValueError("a prompt module needs text context (ctx) or visual prompts (vpt)")
        if ctx is not None:
            if ctx.dim() != 2:
                raise ValueError(f"ctx must be [M, d_t], got {tuple(ctx.shape)}")
            self.ctx = nn.Parameter(ctx.detach().clone())
        else:
            self.register_parameter("ctx", None)
        if vpt is not None:
            if vpt.dim() != 3:
                raise ValueError(f"vpt must be [D, n, d_v], got {tuple(vpt.shape)}")
            self.vpt = nn.Parameter(vpt.detach().clone())
        else:
            self.register_parameter("vpt", None)

    @property
    def n_ctx_text(self) -> int:
        return 0 if self.ctx is None else self.ctx.shape[0]

    @classmethod
    def from_spec(cls, spec: PromptSpec, clip: nn.Module, dims: ClipDims,
                  generator: Optional[torch.Generator] = None) -> "PromptParams":
        """Fresh θ for ``spec`` on a CLIP of widths ``dims`` (random or word init)."""
        device = clip.token_embedding.weight.device
        ctx = vpt = None
        if spec.ctx_init:
            ctx = context_from_words(clip, spec.ctx_init).float()
        elif spec.n_ctx_text > 0:
            ctx = torch.randn(spec.n_ctx_text, dims.text_width, generator=generator) * spec.init_std
        if spec.n_ctx_vision > 0:
            if not 1 <= spec.vision_depth <= dims.vision_layers:
                raise ValueError(f"vision_depth must be in 1..{dims.vision_layers}, got {spec.vision_depth}")
            vpt = initial_visual_prompts(clip, spec.vpt_init, spec.vision_depth, spec.n_ctx_vision,
                                         spec.init_std, generator)
        module = cls(ctx=ctx, vpt=vpt)
        return module.to(device)


class PromptedCLIP:
    """A frozen CLIP that classifies with prompts supplied at call time.

    Caches what does not depend on θ: the class-name token embeddings (per
    name) and, when there is no text context, the fixed-template text features.
    """

    def __init__(self, clip: nn.Module, dims: ClipDims, n_ctx_text: int,
                 template: str = DEFAULT_TEMPLATE, truncate: bool = True):
        self.clip = clip
        self.dims = dims
        self.n_ctx_text = n_ctx_text
        self.template = template
        self.logit_scale = float(clip.logit_scale.exp())
        if n_ctx_text > 0:
            self.tokens = ClassTokenCache(clip, n_ctx_text, template="{}.", truncate=truncate)
        else:
            self.tokens = ClassTokenCache(clip, 0, template=template, truncate=truncate)
        self._fixed_text: dict[str, torch.Tensor] = {}

    def text_features(self, prompts: Optional[nn.Module], classnames: Sequence[str]) -> torch.Tensor:
        """``[C, E]`` L2-normalised class embeddings for the current prompts."""
        ctx = getattr(prompts, "ctx", None) if prompts is not None else None
        if self.n_ctx_text > 0:
            if ctx is None:
                raise ValueError("this PromptedCLIP expects text context vectors (prompts.ctx)")
            feats = encode_text_with_context(self.clip, self.tokens.tokens(classnames), ctx)
            return F.normalize(feats, dim=-1)
        missing = [c for c in dict.fromkeys(classnames) if c not in self._fixed_text]
        if missing:
            with torch.no_grad():
                feats = F.normalize(encode_text_with_context(self.clip, self.tokens.tokens(missing), None), dim=-1)
            for name, f in zip(missing, feats):
                self._fixed_text[name] = f
        return torch.stack([self._fixed_text[c] for c in classnames])

    def image_features(self, prompts: Optional[nn.Module], images: torch.Tensor) -> torch.Tensor:
        """``[B, E]`` L2-normalised image embeddings (with visual prompts when present)."""
        vpt = getattr(prompts, "vpt", None) if prompts is not None else None
        return F.normalize(encode_image_with_prompts(self.clip, images, vpt), dim=-1)

    def logits(self, prompts: Optional[nn.Module], classnames: Sequence[str],
               images: Optional[torch.Tensor] = None,
               image_features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, C]`` scaled cosine logits.

        Pass ``image_features`` (``[B, E]``, normalised) instead of ``images`` when the
        image side carries no prompts: the frozen image tower output can then be cached.
        """
        if image_features is None:
            if images is None:
                raise ValueError("need images or image_features")
            image_features = self.image_features(prompts, images)
        elif getattr(prompts, "vpt", None) is not None:
            raise ValueError("cached image_features cannot be used with visual prompts; pass images")
        text = self.text_features(prompts, classnames)
        return self.logit_scale * image_features @ text.t()


def classification_loss(pclip: PromptedCLIP):
    """The task loss used everywhere: cross-entropy of prompted-CLIP logits.

    Returns ``loss_fn(prompts, batch) -> (loss, logits [n, K])`` where ``batch`` is a dict with
    ``classnames`` (K names), ``label`` (``[n]`` in 0..K-1) and either ``images``
    (``[n, 3, H, W]``) or cached, normalised ``features`` (``[n, E]``; text-only prompts).
    """

    def loss_fn(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = pclip.logits(prompts, batch["classnames"], images=batch.get("images"),
                              image_features=batch.get("features"))
        return F.cross_entropy(logits, batch["label"]), logits

    return loss_fn
