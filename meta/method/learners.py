"""Prompt learners as objects, and their registry (open_clip's model-config registry, CoOp's one class per trainer).

θ is always one :class:`meta.method.prompts.PromptParams` (learn2learn's GBML clones it per task); the learner
object it names (``PromptParams.learner``, a registry key) supplies everything that depends on which tensors θ holds:

* :meth:`PromptLearner.structure_of` / :meth:`PromptLearner.shapes_of`: the structure a ``PromptSpec`` asks for on a
  CLIP, as init files record it, and its tensors ``{name: [shape]}`` in θ's parameter order (= the order of R_φ);
* :meth:`PromptLearner.init`: the start tensors (random draws from the caller's generator);
* :meth:`PromptLearner.text_prompts` / :meth:`PromptLearner.visual_prompts`: what the towers receive, read from any
  object carrying the tensors as attributes (θ, its clones, a task stack ``[B, ...]``: leading dims ride along);
* :meth:`PromptLearner.features` / :meth:`PromptLearner.stacked_features`: the forward, one task or a task stack,
  composing the two above with a :class:`meta.method.prompts.PromptedCLIP`'s towers; a learner whose text prompts
  depend on each image (CoCoOp's meta-net, Zhou et al. CVPR 2022) overrides both and sets
  :attr:`PromptLearner.per_image_text` (text features ``[n, C, E]``); :func:`feature_logits` is the one product.

Adding a learner is one subclass, one :func:`register_learner` call and one row of ``methods.yaml``; the built-in
``clip`` (:class:`meta.method.prompts.ClipPrompts`) covers CoOp, VPT, UNIGRAM, IVLP and MaPLe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:  # torch-free at import: the method table (meta.method.methods) reads DEFAULT_LEARNER without torch
    import torch
    from torch import nn

    from meta.method.prompts import PromptSpec
    from meta.model.backbone import ClipDims

# The learner a θ without a ``learner`` attribute (and an init file without ``prompt.learner``) is read as.
DEFAULT_LEARNER = "clip"

_REGISTRY: dict[str, "PromptLearner"] = {}


class PromptLearner:
    """How one kind of prompt learner holds θ and prompts CLIP's towers (see the module docstring).

    Subclasses set :attr:`key` and :attr:`tensor_names` and implement the methods that raise here.  ``structure``
    dicts hold at least ``n_ctx_text`` (M, 0 = the fixed template), ``n_ctx_vision`` and ``vision_depth`` (free
    visual tokens), ``text_depth`` and ``coupling``; a learner may add fields of its own.
    """

    key: str = ""
    #: every tensor name θ of this learner may hold, in parameter order
    tensor_names: tuple[str, ...] = ()

    def structure_of(self, spec: Any, dims: Any) -> dict:
        """The structure ``spec`` (a :class:`meta.method.prompts.PromptSpec`) gives on a CLIP of widths ``dims``."""
        raise NotImplementedError

    def shapes_of(self, structure: Mapping[str, Any], backbone: Mapping[str, Any]) -> dict[str, tuple[list, str]]:
        """``{name: (shape, formula)}`` of the tensors ``structure`` holds on ``backbone`` (widths, layers).

        ``formula`` names the fields the shape comes from (for error messages)."""
        raise NotImplementedError

    def init(self, spec: Any, clip: nn.Module, dims: Any, generator: Optional[torch.Generator]) -> dict:
        """``{name: tensor}`` at the start (float32, on the CPU unless the rule reads the CLIP's device)."""
        raise NotImplementedError

    def check(self, tensors: Mapping[str, Optional[torch.Tensor]]) -> None:
        """ValueError when the given tensors (absent = ``None``) do not form a θ of this learner."""
        unknown = sorted(set(tensors) - set(self.tensor_names))
        if unknown:
            raise ValueError(
                f"prompt learner {self.key!r} holds {', '.join(self.tensor_names)}; got unknown {', '.join(unknown)}"
            )

    def structure(self, prompts: Any) -> dict:
        """The structure of a θ (inverse of :meth:`shapes_of`: what an init file records)."""
        raise NotImplementedError

    def text_prompts(self, prompts: Any) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(ctx [..., M, d_t] or None, deep [..., J-1, M, d_t] or None)`` for the text tower."""
        raise NotImplementedError

    def visual_prompts(self, prompts: Any) -> Optional[torch.Tensor]:
        """``[..., D, n, d_v]`` tokens for the vision tower, or ``None``."""
        raise NotImplementedError

    def spec_prompts_vision(self, spec: Any) -> bool:
        """Whether θ of ``spec`` prompts the vision tower (decides whether image features may be cached)."""
        return bool(spec.has_visual_prompts)

    def has_visual_prompts(self, prompts: Any) -> bool:
        """Whether the vision tower carries prompts (cached image features are then refused)."""
        return self.visual_prompts(prompts) is not None

    # ------------------------------------------------------------------ the forward (θ, images, names -> logits)
    #: True when the text features depend on each image (``features`` returns text ``[n, C, E]``); the text side
    #: then cannot be computed once per class list (:meth:`text_features` refuses, the Dassl model does not cache)
    per_image_text: bool = False

    def text_features(self, pclip: Any, prompts: Any, classnames: Sequence[str]) -> torch.Tensor:
        """``[C, E]`` L2-normalised class embeddings of θ (``prompts``) through ``pclip``'s frozen text tower.

        ValueError for a learner with :attr:`per_image_text` (its text side needs the images: use :meth:`features`)."""
        if self.per_image_text:
            raise ValueError(
                f"prompt learner {self.key!r}: text features depend on each image; use features() or logits()"
            )
        ctx, deep = self.text_prompts(prompts)
        return pclip.encode_text(ctx, deep, classnames)

    def image_features(self, pclip: Any, prompts: Any, images: torch.Tensor) -> torch.Tensor:
        """``[n, E]`` L2-normalised image embeddings of ``images`` ``[n, 3, H, W]`` with θ's visual prompts."""
        return pclip.encode_images(images, self.visual_prompts(prompts))

    def image_side(
        self, pclip: Any, prompts: Any, images: Optional[torch.Tensor], cached: Optional[torch.Tensor], tasks: int = 0
    ) -> torch.Tensor:
        """``cached`` image features (from the frozen tower: refused when θ prompts it), else :meth:`image_features`
        of ``images``: ``[n, E]``, or ``[B, n, E]`` for ``tasks`` B (images task-major)."""
        if cached is not None:
            if self.has_visual_prompts(prompts):
                raise ValueError("cached image_features cannot be used with visual prompts; pass images")
            return cached
        if images is None:
            raise ValueError("need images or image_features")
        image = self.image_features(pclip, prompts, images)
        return image.view(tasks, images.shape[0] // tasks, -1) if tasks else image

    def features(
        self,
        pclip: Any,
        prompts: Any,
        classnames: Sequence[str],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image [n, E], text [C, E] or per image [n, C, E])``, L2-normalised: what :meth:`logits` multiplies.

        ``images`` ``[n, 3, H, W]``, or ``image_features`` ``[n, E]`` (:meth:`image_side`)."""
        return self.image_side(pclip, prompts, images, image_features), self.text_features(pclip, prompts, classnames)

    def stacked_features(
        self,
        pclip: Any,
        prompts: Any,
        classnames: Sequence[Sequence[str]],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`features` of B tasks in one pass: ``(image [B, n, E], text [B, K, E] or per image [B, n, K, E])``.

        ``prompts`` holds θ stacked per task (every tensor ``[B, ...]``, :class:`meta.method.batched.StackedPrompts`),
        ``classnames`` B lists of K names, ``images`` ``[B·n, 3, H, W]`` (task-major) or ``image_features``
        ``[B, n, E]``.  Task b's images meet task b's visual prompts (a per-sample gather in the vision tower) and
        its K names become K text sequences with task b's context (B·K sequences in one text batch)."""
        if self.per_image_text:
            raise ValueError(f"prompt learner {self.key!r}: per-image text needs its own stacked_features()")
        n_tasks = len(classnames)
        image = self.image_side(pclip, prompts, images, image_features, n_tasks)
        n_cls = len(classnames[0])
        flat = [c for names in classnames for c in names]
        if pclip.n_ctx_text == 0:  # the fixed template: cached per class name
            return image, pclip.encode_text(None, None, flat).view(n_tasks, n_cls, -1)
        ctx, deep = self.text_prompts(prompts)
        if ctx is None:
            raise ValueError("this PromptedCLIP expects text context vectors (prompts.ctx)")
        # B·K sequences: class k of task b carries ctx[b] (and deep[b])
        ctx, deep = (None if t is None else t.repeat_interleave(n_cls, dim=0) for t in (ctx, deep))
        return image, pclip.encode_text(ctx, deep, flat).view(n_tasks, n_cls, -1)

    def logits(
        self,
        pclip: Any,
        prompts: Any,
        classnames: Sequence[str],
        images: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[n, C]`` scaled cosine logits of :meth:`features` (:func:`feature_logits`)."""
        return feature_logits(pclip.logit_scale, *self.features(pclip, prompts, classnames, images, image_features))


def text_only_structure(n_ctx_text: int, **fields: Any) -> dict:
    """The ``structure`` of a learner that prompts only the text tower, in its first layer (CoOp's place, as CoCoOp's
    meta-net does): ``n_ctx_text`` context positions, no visual tokens, depth 1, no coupling, plus the learner's own
    ``fields`` (what :meth:`PromptLearner.structure_of` and :meth:`PromptLearner.structure` return)."""
    return {
        "n_ctx_text": int(n_ctx_text),
        "n_ctx_vision": 0,
        "vision_depth": 0,
        "text_depth": 1,
        "coupling": "none",
        **fields,
    }


def feature_logits(scale: float, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Scaled cosine logits of normalised features, one task or a task stack, shared or per-image text.

    * one task: ``image [n, E]`` with ``text [C, E]`` -> ``(scale · image) @ textᵀ``, or with per-image
      ``text [n, C, E]`` -> ``einsum("ne,nce->nc")``: ``[n, C]``;
    * a task stack: ``image [B, n, E]`` with ``text [B, K, E]`` -> ``scale · bmm(image, textᵀ)``, or with
      ``text [B, n, K, E]`` -> ``einsum("bne,bnke->bnk")``: ``[B, n, K]``.

    (Where the scale multiplies is each path's as it always was, so built-in learners' numbers do not move.)"""
    import torch

    if image.dim() == 2 and text.dim() == 2:
        return scale * image @ text.t()
    if image.dim() == 2 and text.dim() == 3:
        return torch.einsum("ne,nce->nc", scale * image, text)
    if image.dim() == 3 and text.dim() == 3:
        return scale * torch.bmm(image, text.transpose(1, 2))
    if image.dim() == 3 and text.dim() == 4:
        return scale * torch.einsum("bne,bnke->bnk", image, text)
    raise ValueError(
        f"feature_logits: expected image [n, E] / [B, n, E] with text [C, E] or [n, C, E] (one more leading "
        f"task dim when stacked), got {tuple(image.shape)} and {tuple(text.shape)}"
    )


def consistency_text(text: torch.Tensor, classnames: Sequence[str]) -> tuple[torch.Tensor, list[str]]:
    """The text features and class names the zero-shot consistency term (:mod:`meta.method.consistency`) reads.

    ``text [C, E]`` -> unchanged; per-image ``text [n, C, E]`` -> ``([n·C, E], classnames repeated n times)``, so
    the term becomes ``1 − mean_{i,k} cos(w_ik, w_k⁰)``: KgCoOp's penalty averaged over the images too."""
    if text.dim() == 2:
        return text, list(classnames)
    if text.dim() != 3 or text.shape[1] != len(classnames):
        raise ValueError(
            f"text features: expected [C, E] or [n, C, E] with C = {len(classnames)}, got {tuple(text.shape)}"
        )
    return text.reshape(-1, text.shape[-1]), list(classnames) * text.shape[0]


def register_learner(learner: PromptLearner) -> PromptLearner:
    """Add ``learner`` under ``learner.key`` (a second learner with a taken key is refused)."""
    if not learner.key or not learner.tensor_names:
        raise ValueError("a prompt learner needs a key and tensor_names")
    held = _REGISTRY.get(learner.key)
    if held is not None and held is not learner:
        raise ValueError(f"prompt learner {learner.key!r} is already registered ({type(held).__name__})")
    _REGISTRY[learner.key] = learner
    return learner


def unregister_learner(key: str) -> None:
    """Remove ``key`` (tests that register a learner of their own clean up with it)."""
    if key == DEFAULT_LEARNER:
        raise ValueError(f"the built-in learner {DEFAULT_LEARNER!r} cannot be removed")
    _REGISTRY.pop(key, None)


def get_learner(key: str) -> PromptLearner:
    """The learner registered as ``key``; ValueError naming the known keys otherwise.

    The built-in learner registers when :mod:`meta.method.prompts` is imported (every module that holds θ imports
    it)."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"unknown prompt learner {key!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def import_learner_modules(modules: Any, key: str) -> list[str]:
    """Import the Python modules that register your learners (``register_learner`` at import), so that a command
    line run can name them: ``modules`` is the value of the config key ``key`` (``META.PROMPT.LEARNER_MODULES`` or
    ``TRAINER.GRAM.LEARNER_MODULES``), a list of dotted module names found on ``sys.path`` (the folder the command
    runs from, or ``PYTHONPATH``).  Returns the names imported; ValueError naming ``key`` and the module otherwise."""
    import importlib

    if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
        raise ValueError(f"{key}: expected a list of module names (e.g. ['my_learners']), got {modules!r}")
    done = []
    for name in modules:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{key}: expected module names, got {name!r}")
        try:
            importlib.import_module(name.strip())
        except Exception as err:  # noqa: BLE001 - any failure of the user's module is reported by name, in one line
            raise ValueError(f"{key}: cannot import {name!r} ({type(err).__name__}: {err})") from None
        done.append(name.strip())
    return done


def learner_keys() -> tuple[str, ...]:
    """The registered learner keys, sorted."""
    return tuple(sorted(_REGISTRY))


def learner_of(prompts: Any) -> PromptLearner:
    """The learner of a θ-like object (its ``learner`` attribute; :data:`DEFAULT_LEARNER` without one)."""
    return get_learner(getattr(prompts, "learner", None) or DEFAULT_LEARNER)


def init_expectations(prompt: "PromptSpec", dims: "ClipDims") -> dict:
    """What a GRAM init file must say to fit θ of ``prompt`` on the CLIP of ``dims`` (``load_gram_init``'s
    ``expect``): widths, model, and the structure ``prompt``'s learner gives (for the built-in learner: token
    counts, resolved depths, 0 for an absent side, and coupling)."""
    expect = {"text_width": dims.text_width, "vision_width": dims.vision_width, "model_name": dims.model_name}
    expect.update(get_learner(prompt.learner).structure_of(prompt, dims))
    if prompt.learner != DEFAULT_LEARNER:
        expect["learner"] = prompt.learner
    return expect


def check_start_structure(prompt: "PromptSpec", dims: "ClipDims", prompts: "nn.Module", where: str) -> None:
    """ValueError naming ``where`` when an in-memory θ does not have the structure and tensor shapes of ``prompt``."""
    learner = get_learner(prompt.learner)
    backbone = {"text_width": dims.text_width, "vision_width": dims.vision_width}
    want = {
        name: tuple(shape)
        for name, (shape, _) in learner.shapes_of(learner.structure_of(prompt, dims), backbone).items()
    }
    have = {name: tuple(p.shape) for name, p in prompts.named_parameters()}
    problems = []
    if getattr(prompts, "learner", DEFAULT_LEARNER) != prompt.learner:
        problems.append(
            f"learner is {getattr(prompts, 'learner', DEFAULT_LEARNER)!r}, method expects {prompt.learner!r}"
        )
    for name in dict.fromkeys([*want, *have]):
        if want.get(name) != have.get(name):
            problems.append(f"{name} is {have.get(name)}, method expects {want.get(name)}")
    if problems:
        raise ValueError(f"{where}: start point does not fit: " + "; ".join(problems))
