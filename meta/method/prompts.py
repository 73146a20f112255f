"""Learnable prompts θ and the prompted (frozen) CLIP that consumes them.

θ lives in one small module, :class:`PromptParams`, holding the tensors of its prompt learner
(:mod:`meta.method.learners`: a registry of learner objects that say which tensors θ holds and how they prompt the
towers).  The built-in learner, :class:`ClipPrompts` (key ``clip``), holds these (each optional):

* ``ctx``: ``[M, d_t]`` text context vectors (CoOp), present when ``n_ctx_text > 0``;
* ``vpt``: ``[D, n, d_v]`` visual prompt tokens (VPT), present when ``n_ctx_vision > 0``
  (``D = 1`` shallow, ``D > 1`` deep);
* ``ctx_deep``: ``[J - 1, M, d_t]`` deep text prompts (IVLP / MaPLe ``PROMPT_DEPTH`` J > 1) for text blocks
  ``1..J-1`` (:func:`meta.model.text_encoder.encode_text_with_context`);
* ``proj_weight`` ``[J, d_v, d_t]`` and ``proj_bias`` ``[J, d_v]``: MaPLe's coupling: vision layer ``i < J`` gets
  ``t_i W_iᵀ + b_i`` (``t_0 = ctx``, ``t_i = ctx_deep[i - 1]``, :meth:`ClipPrompts.visual_prompts`) as deep VPT tokens
  (MaPLe, Khattak et al. CVPR 2023, the V-L coupling function F_i; muzairkhattak/multimodal-prompt-learning
  ``trainers/maple.py``: ``proj`` for layer 0 and ``compound_prompt_projections`` for layers 1..J-1).

Each tensor gets one R_φ (the layers of one tensor share it, as deep VPT does).  The frozen CLIP is *not* a submodule:
:class:`PromptedCLIP` holds it and takes θ at call time, so learn2learn's ``GBML`` clones only θ per task.

Methods: CoOp = text only; VPT = vision only, text side the fixed prompt ``"a photo of a {}."`` (paper's VPT baseline);
UNIGRAM = both (paper: 2 + 2); IVLP = deep text and deep visual prompts, independent (``text_depth`` J, ``vision_depth``
D); MaPLe = deep text prompts plus coupled visual prompts (``coupling="maple"``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meta.method.cocoop import linear_default_init  # (importing it registers CoCoOp wherever θ is built)
from meta.method.consistency import ConsistencySpec, consistency_penalty, frozen_reference
from meta.method.learners import (
    DEFAULT_LEARNER,
    PromptLearner,
    consistency_text,
    feature_logits,
    get_learner,
    learner_of,
    register_learner,
)
from meta.model.backbone import ClipDims
from meta.model.text_encoder import ClassTokenCache, context_from_words, encode_text_with_context
from meta.model.visual_encoder import encode_image_with_prompts

# CoOp's hand-made prompt: zero-shot CLIP's text and the fixed text side of VPT (CoOp paper, section 4.1).
DEFAULT_TEMPLATE = "a photo of a {}."

# Initialisations of the visual prompt tokens (PromptSpec.vpt_init).
VPT_INITS = ("normal", "zeros", "cls", "patch_mean")

# How the visual prompts relate to the text prompts (PromptSpec.coupling): independent (VPT / IVLP)
# or produced from the text prompts by a learned linear map per layer (MaPLe).
COUPLINGS = ("none", "maple")

# Every θ tensor PromptParams may hold, in the order of its parameters (= the order of R_φ in GBML).
PROMPT_TENSORS = ("ctx", "vpt", "ctx_deep", "proj_weight", "proj_bias")


@torch.no_grad()
def initial_visual_prompts(
    clip: nn.Module, how: str, depth: int, n: int, init_std: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``[depth, n, d_v]`` initial visual prompt tokens (float32, on the CPU).

    Layer-0 tokens are appended before ``ln_pre``, which rescales every token to unit variance (a random token enters
    at full scale whatever ``init_std``); the rules other than ``normal`` start from a token of the frozen tower:

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
    pos = visual.positional_embedding.detach().float().cpu()  # [1 + g*g, d_v]
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
    bases = torch.stack([base] + [deep] * (depth - 1)).unsqueeze(1)  # [depth, 1, d_v]
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
        init_std, template: std of random prompt starts (CoOp: 0.02); the fixed text prompt without text context.
        vpt_init: how the visual tokens start (:data:`VPT_INITS`, the rules of :func:`initial_visual_prompts`).
        text_depth: J, text layers that receive learnable context (1 = CoOp; J > 1 adds ``ctx_deep`` for layers 1..J-1,
            started from N(0, init_std²) as IVLP and MaPLe do; 0 = every text layer, with ``maple`` every layer both
            towers have; see :meth:`resolved`).  ``vision_depth`` 0 = every vision layer likewise.
        coupling: ``none`` (visual prompts, if any, are their own tensor ``vpt``) or ``maple`` (the
            visual prompts of the first J vision layers are projections of the J text prompts; then
            ``n_ctx_vision`` must be 0: MaPLe has no independent visual prompts).
        learner: the prompt learner that holds θ (:mod:`meta.method.learners` registry key); ``clip`` = the built-in
            :class:`ClipPrompts`, shaped by the fields above.  A registered learner of its own reads the fields
            it needs.
    """

    n_ctx_text: int = 4
    ctx_init: str = ""
    n_ctx_vision: int = 0
    vision_depth: int = 1
    init_std: float = 0.02
    template: str = DEFAULT_TEMPLATE
    vpt_init: str = "patch_mean"  # chosen on the val splits (docs/notes/world_baseline.md)
    text_depth: int = 1
    coupling: str = "none"
    learner: str = DEFAULT_LEARNER

    def __post_init__(self) -> None:
        if self.vpt_init not in VPT_INITS:
            raise ValueError(f"vpt_init must be one of {', '.join(VPT_INITS)}, got {self.vpt_init!r}")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"coupling must be one of {', '.join(COUPLINGS)}, got {self.coupling!r}")
        if int(self.text_depth) < 0 or int(self.vision_depth) < 0:
            raise ValueError(
                f"text_depth and vision_depth must be >= 0 (0 = all layers), got "
                f"{self.text_depth} and {self.vision_depth}"
            )
        has_text = self.n_ctx_text > 0 or bool(self.ctx_init)
        if (self.text_depth != 1 or self.coupling != "none") and not has_text:
            raise ValueError(
                "deep text prompts (text_depth > 1) and the MaPLe coupling need text context "
                "(n_ctx_text > 0 or ctx_init)"
            )
        if self.coupling == "maple" and self.n_ctx_vision > 0:
            raise ValueError(
                f"coupling 'maple' derives the visual prompts from the text prompts; "
                f"n_ctx_vision must be 0, got {self.n_ctx_vision}"
            )

    def resolved(self, dims: ClipDims) -> "PromptSpec":
        """This spec with depth 0 ("all layers") replaced by the layer count of the CLIP of ``dims``."""
        text_all = min(dims.text_layers, dims.vision_layers) if self.coupling == "maple" else dims.text_layers
        return replace(
            self, text_depth=self.text_depth or text_all, vision_depth=self.vision_depth or dims.vision_layers
        )

    @property
    def has_visual_prompts(self) -> bool:
        """True when the image tower carries prompts (free tokens or MaPLe's coupled ones)."""
        return self.n_ctx_vision > 0 or self.coupling != "none"

    def as_dict(self) -> dict:
        """The fields; ``learner`` only when it is not the built-in one (records written before it existed)."""
        d = asdict(self)
        if d["learner"] == DEFAULT_LEARNER:
            del d["learner"]
        return d


class PromptParams(nn.Module):
    """θ, the learnable prompt tensors of one prompt learner, as ``nn.Parameter`` attributes (absent ones ``None``);
    the frozen CLIP is not part of it, so ``GBML.clone()`` copies θ alone.

    ``learner`` (:mod:`meta.method.learners` key, default ``clip``) names the tensors θ may hold, checks them against
    each other and says how they prompt the towers; ``tensors`` by name (for ``clip``, those of the module docstring,
    at least one of ``ctx`` and ``vpt``).  Example::

        clip, dims = load_clip("GRAM-Test-Tiny", pretrained=None)
        theta = PromptParams.from_spec(PromptSpec(n_ctx_text=2, n_ctx_vision=2), clip, dims)   # UNIGRAM
        theta.ctx.shape, theta.vpt.shape   # ([2, d_t], [1, 2, d_v])
    """

    def __init__(self, learner: str = DEFAULT_LEARNER, **tensors: Optional[torch.Tensor]):
        super().__init__()
        impl = get_learner(learner)
        impl.check(tensors)
        self.learner = learner
        for name in impl.tensor_names:
            value = tensors.get(name)
            if value is None:
                self.register_parameter(name, None)
            else:
                setattr(self, name, nn.Parameter(value.detach().clone()))

    @property
    def n_ctx_text(self) -> int:
        """M, the context positions of the text prompt (0 = the fixed template)."""
        return self.structure()["n_ctx_text"]

    @property
    def text_depth(self) -> int:
        """J, text layers with learnable context (0 without text context)."""
        return self.structure()["text_depth"]

    @property
    def coupling(self) -> str:
        return self.structure()["coupling"]

    def structure(self) -> dict:
        """The prompt structure as init files record it (:meth:`meta.method.learners.PromptLearner.structure`), with
        ``learner`` when it is not the built-in one (files of the built-in learner read as before the field)."""
        out = get_learner(self.learner).structure(self)
        if self.learner != DEFAULT_LEARNER:
            out["learner"] = self.learner
        return out

    @classmethod
    def from_spec(
        cls, spec: PromptSpec, clip: nn.Module, dims: ClipDims, generator: Optional[torch.Generator] = None
    ) -> "PromptParams":
        """Fresh θ for ``spec`` on a CLIP of widths ``dims`` (random or word init), by ``spec.learner``."""
        device = clip.token_embedding.weight.device
        tensors = get_learner(spec.learner).init(spec, clip, dims, generator)
        return cls(spec.learner, **tensors).to(device)


class ClipPrompts(PromptLearner):
    """The built-in learner ``clip``: CoOp, VPT, UNIGRAM, IVLP and MaPLe, the tensors of the module docstring."""

    key = DEFAULT_LEARNER
    tensor_names = PROMPT_TENSORS

    def structure_of(self, spec: PromptSpec, dims: ClipDims) -> dict:
        r = spec.resolved(dims)
        return {
            "n_ctx_text": r.n_ctx_text,
            "n_ctx_vision": r.n_ctx_vision,
            "vision_depth": r.vision_depth if r.n_ctx_vision else 0,
            "text_depth": r.text_depth if r.n_ctx_text else 0,
            "coupling": r.coupling,
        }

    def shapes_of(self, structure, backbone) -> dict[str, tuple[list, str]]:
        pr, bb = structure, backbone
        out = {}
        if pr["n_ctx_text"]:
            out["ctx"] = ([pr["n_ctx_text"], bb["text_width"]], "[prompt.n_ctx_text, backbone.text_width]")
        if pr["n_ctx_vision"]:
            out["vpt"] = (
                [pr["vision_depth"], pr["n_ctx_vision"], bb["vision_width"]],
                "[prompt.vision_depth, prompt.n_ctx_vision, backbone.vision_width]",
            )
        if pr.get("text_depth", 1) > 1:
            out["ctx_deep"] = (
                [pr["text_depth"] - 1, pr["n_ctx_text"], bb["text_width"]],
                "[prompt.text_depth - 1, prompt.n_ctx_text, backbone.text_width]",
            )
        if pr.get("coupling", "none") == "maple":
            out["proj_weight"] = (
                [pr["text_depth"], bb["vision_width"], bb["text_width"]],
                "[prompt.text_depth, backbone.vision_width, backbone.text_width]",
            )
            out["proj_bias"] = ([pr["text_depth"], bb["vision_width"]], "[prompt.text_depth, backbone.vision_width]")
        return out

    def init(self, spec: PromptSpec, clip: nn.Module, dims: ClipDims, generator: Optional[torch.Generator]) -> dict:
        spec = spec.resolved(dims)
        ctx = vpt = None
        if spec.ctx_init:
            ctx = context_from_words(clip, spec.ctx_init).float()
        elif spec.n_ctx_text > 0:
            ctx = torch.randn(spec.n_ctx_text, dims.text_width, generator=generator) * spec.init_std
        if spec.n_ctx_vision > 0:
            if not 1 <= spec.vision_depth <= dims.vision_layers:
                raise ValueError(f"vision_depth must be in 1..{dims.vision_layers}, got {spec.vision_depth}")
            vpt = initial_visual_prompts(
                clip, spec.vpt_init, spec.vision_depth, spec.n_ctx_vision, spec.init_std, generator
            )
        # deep and coupled tensors are drawn after ctx and vpt: the shallow methods' draws are unchanged
        ctx_deep = weight = bias = None
        if spec.text_depth > 1:
            limit = min(dims.text_layers, dims.vision_layers) if spec.coupling == "maple" else dims.text_layers
            if spec.text_depth > limit:
                raise ValueError(f"text_depth must be in 1..{limit}, got {spec.text_depth}")
            ctx_deep = torch.randn(spec.text_depth - 1, ctx.shape[0], ctx.shape[1], generator=generator) * spec.init_std
        if spec.coupling == "maple":
            weight, bias = initial_projections(spec.text_depth, dims.text_width, dims.vision_width, generator)
        return {"ctx": ctx, "vpt": vpt, "ctx_deep": ctx_deep, "proj_weight": weight, "proj_bias": bias}

    def check(self, tensors) -> None:
        super().check(tensors)
        ctx, vpt, ctx_deep = tensors.get("ctx"), tensors.get("vpt"), tensors.get("ctx_deep")
        proj_weight, proj_bias = tensors.get("proj_weight"), tensors.get("proj_bias")
        if ctx is None and vpt is None:
            raise ValueError("a prompt module needs text context (ctx) or visual prompts (vpt)")
        if ctx is not None and ctx.dim() != 2:
            raise ValueError(f"ctx must be [M, d_t], got {tuple(ctx.shape)}")
        if vpt is not None and vpt.dim() != 3:
            raise ValueError(f"vpt must be [D, n, d_v], got {tuple(vpt.shape)}")
        if ctx_deep is not None:
            if ctx is None or ctx_deep.dim() != 3 or ctx_deep.shape[1:] != ctx.shape:
                raise ValueError(
                    f"ctx_deep must be [J-1, M, d_t] with [M, d_t] = ctx's shape "
                    f"{None if ctx is None else tuple(ctx.shape)}, got {tuple(ctx_deep.shape)}"
                )
        if (proj_weight is None) != (proj_bias is None):
            raise ValueError("the MaPLe coupling needs both proj_weight [J, d_v, d_t] and proj_bias [J, d_v]")
        if proj_weight is not None:
            depth = 1 + (0 if ctx_deep is None else ctx_deep.shape[0])
            if ctx is None or vpt is not None:
                raise ValueError("the MaPLe coupling (proj_weight) needs ctx and replaces vpt (give no vpt)")
            if (
                proj_weight.dim() != 3
                or proj_weight.shape[0] != depth
                or proj_weight.shape[2] != ctx.shape[1]
                or tuple(proj_bias.shape) != (depth, proj_weight.shape[1])
            ):
                raise ValueError(
                    f"proj_weight must be [J={depth}, d_v, d_t={ctx.shape[1]}] and proj_bias "
                    f"[J, d_v], got {tuple(proj_weight.shape)} and {tuple(proj_bias.shape)}"
                )

    def structure(self, prompts) -> dict:
        """``n_ctx_vision`` / ``vision_depth`` describe the free visual tokens ``vpt`` only (0 for MaPLe,
        whose visual prompts follow from ``text_depth`` and ``coupling``)."""
        ctx, vpt, deep = prompts.ctx, prompts.vpt, prompts.ctx_deep
        return {
            "n_ctx_text": 0 if ctx is None else ctx.shape[0],
            "n_ctx_vision": 0 if vpt is None else vpt.shape[1],
            "vision_depth": 0 if vpt is None else vpt.shape[0],
            "text_depth": 0 if ctx is None else 1 + (0 if deep is None else deep.shape[0]),
            "coupling": "none" if prompts.proj_weight is None else "maple",
        }

    def text_prompts(self, prompts) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return getattr(prompts, "ctx", None), getattr(prompts, "ctx_deep", None)

    def visual_prompts(self, prompts) -> Optional[torch.Tensor]:
        """The free tokens ``vpt`` (VPT / IVLP), or MaPLe's coupled ones: layer i gets ``t_i W_iᵀ + b_i`` with
        ``t_0 = ctx``, ``t_i = ctx_deep[i-1]`` (D = J, n = M)."""
        vpt = getattr(prompts, "vpt", None)
        weight = getattr(prompts, "proj_weight", None)
        if weight is None:
            return vpt
        ctx, deep = self.text_prompts(prompts)
        # any leading task dimensions ride along (meta.method.batched: ctx [B, M, d_t], weight [B, J, d_v, d_t], ...)
        layers = ctx.unsqueeze(-3) if deep is None else torch.cat([ctx.unsqueeze(-3), deep], dim=-3)  # [J, M, d_t]
        bias = getattr(prompts, "proj_bias")
        return torch.matmul(layers, weight.transpose(-1, -2)) + bias.unsqueeze(-2)  # [J, M, d_v]

    def has_visual_prompts(self, prompts) -> bool:
        return getattr(prompts, "vpt", None) is not None or getattr(prompts, "proj_weight", None) is not None


register_learner(ClipPrompts())


def initial_projections(
    depth: int, d_in: int, d_out: int, generator: Optional[torch.Generator] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MaPLe's coupling maps at their start: ``([J, d_out, d_in], [J, d_out])`` (float32), ``nn.Linear``'s default
    start; layer 0 has its own draw, layers 1..J-1 copies of one (deep copies of a single ``nn.Linear`` in
    multimodal-prompt-learning ``trainers/maple.py``, ``_get_clones``)."""
    w0, b0 = linear_default_init(d_out, d_in, generator)
    weight, bias = [w0], [b0]
    if depth > 1:
        w1, b1 = linear_default_init(d_out, d_in, generator)
        weight += [w1] * (depth - 1)
        bias += [b1] * (depth - 1)
    return torch.stack(weight), torch.stack(bias)


def visual_prompts(prompts: Optional[nn.Module]) -> Optional[torch.Tensor]:
    """``[D, n, d_v]`` tokens for the vision tower, or ``None``, by θ's learner, of any object with the learner's
    tensors as attributes (l2l clones of :class:`PromptParams`, task stacks ``[B, ...]``, plain views in tests)."""
    return None if prompts is None else learner_of(prompts).visual_prompts(prompts)


class PromptedCLIP:
    """A frozen CLIP that classifies with prompts supplied at call time, caching what does not depend on θ; how θ turns
    images and class names into features is θ's learner's (:meth:`meta.method.learners.PromptLearner.features`)."""

    def __init__(
        self, clip: nn.Module, dims: ClipDims, n_ctx_text: int, template: str = DEFAULT_TEMPLATE, truncate: bool = True
    ):
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

    # ---------------------------------------------------------------- the frozen towers
    def encode_text(
        self, ctx: Optional[torch.Tensor], ctx_deep: Optional[torch.Tensor], classnames: Sequence[str]
    ) -> torch.Tensor:
        """``[C, E]`` L2-normalised text features of ``classnames`` with context ``ctx`` (``[M, d_t]`` shared, or
        ``[C, M, d_t]`` one per name) and deep prompts ``ctx_deep`` (``[J-1, M, d_t]`` or ``[C, J-1, M, d_t]``).

        Without text context (``n_ctx_text`` 0) the fixed template's features, cached per name (``ctx`` ignored)."""
        if self.n_ctx_text > 0:
            if ctx is None:
                raise ValueError("this PromptedCLIP expects text context vectors (prompts.ctx)")
            feats = encode_text_with_context(self.clip, self.tokens.tokens(classnames), ctx, ctx_deep)
            return F.normalize(feats, dim=-1)
        missing = [c for c in dict.fromkeys(classnames) if c not in self._fixed_text]
        if missing:
            with torch.no_grad():
                feats = F.normalize(encode_text_with_context(self.clip, self.tokens.tokens(missing), None), dim=-1)
            for name, f in zip(missing, feats):
                self._fixed_text[name] = f
        return torch.stack([self._fixed_text[c] for c in classnames])

    def encode_images(self, images: torch.Tensor, visual: Optional[torch.Tensor]) -> torch.Tensor:
        """``[n, E]`` L2-normalised image features of ``images`` ``[n, 3, H, W]`` with visual prompt tokens
        ``visual`` (``[D, n_v, d_v]``; ``[G, D, n_v, d_v]``: the images in G equal consecutive groups, group g with
        ``visual[g]``, the tasks of :mod:`meta.method.batched`; or ``None``)."""
        return F.normalize(encode_image_with_prompts(self.clip, images, visual), dim=-1)

    # ---------------------------------------------------------------- θ's forward (by its learner)
    def text_features(self, prompts: Optional[nn.Module], classnames: Sequence[str]) -> torch.Tensor:
        """``[C, E]`` L2-normalised class embeddings for the current prompts (``None``: the fixed template)."""
        if prompts is None:
            return self.encode_text(None, None, classnames)
        return learner_of(prompts).text_features(self, prompts, classnames)

    def image_features(self, prompts: Optional[nn.Module], images: torch.Tensor) -> torch.Tensor:
        """``[B, E]`` L2-normalised image embeddings (with visual prompts when present)."""
        if prompts is None:
            return self.encode_images(images, None)
        return learner_of(prompts).image_features(self, prompts, images)

    def logits(
        self,
        prompts: Optional[nn.Module],
        classnames: Sequence[str],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[B, C]`` scaled cosine logits; ``image_features`` (``[B, E]``, normalised, cacheable) may stand in for
        ``images`` when the image side carries no prompts."""
        return feature_logits(self.logit_scale, *self.features(prompts, classnames, images, image_features))

    def features(
        self,
        prompts: Optional[nn.Module],
        classnames: Sequence[str],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image [B, E], text [C, E] or per image [B, C, E])``, both L2-normalised: what :meth:`logits`
        multiplies (:meth:`meta.method.learners.PromptLearner.features` of θ's learner)."""
        return learner_of(prompts).features(self, prompts, classnames, images, image_features)


def classification_loss(pclip: PromptedCLIP, consistency: Optional[ConsistencySpec] = None):
    """The task loss used everywhere: cross-entropy of prompted-CLIP logits, plus the zero-shot consistency
    terms of :mod:`meta.method.consistency` when ``consistency`` is active (fine-tuning only).

    Returns ``loss_fn(prompts, batch) -> (loss, logits [n, K])`` for a dict ``batch`` of ``classnames`` (K names),
    ``label`` (``[n]`` in 0..K-1) and ``images`` ``[n, 3, H, W]`` or cached, normalised ``features`` ``[n, E]``, with
    attributes ``pclip``, ``consistency`` (the active spec or None), ``task_loss`` (the cross-entropy alone) and
    ``parts(prompts, batch) -> (cross-entropy, consistency penalty, logits)`` (None without the terms).
    """
    spec = consistency if consistency is not None and consistency.active else None

    def loss_fn(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = pclip.logits(
            prompts, batch["classnames"], images=batch.get("images"), image_features=batch.get("features")
        )
        return F.cross_entropy(logits, batch["label"]), logits

    def parts_fn(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images = batch.get("images")
        image, text = pclip.features(prompts, batch["classnames"], images, batch.get("features"))
        logits = feature_logits(pclip.logit_scale, image, text)
        text, names = consistency_text(text, batch["classnames"])  # per-image text: the mean over images
        penalty = consistency_penalty(spec, reference, names, text, image, images, visual_prompts(prompts) is not None)
        return F.cross_entropy(logits, batch["label"]), penalty, logits

    def regularised_loss_fn(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        task, penalty, logits = parts_fn(prompts, batch)
        return task + penalty, logits

    if spec is None:
        fn = loss_fn
    else:
        reference = frozen_reference(pclip.clip, DEFAULT_TEMPLATE)
        fn = regularised_loss_fn
    fn.pclip = pclip  # meta.method.batched builds the task-stacked twin from it (meta.method.gram's task batching)
    fn.consistency = spec
    fn.task_loss = loss_fn
    fn.parts = parts_fn if spec is not None else None
    return fn
