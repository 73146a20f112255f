"""Prompt learners as objects, and their registry (open_clip's model-config registry, CoOp's one class per trainer).

A prompt learner says how θ is held and how it prompts the frozen CLIP's towers.  θ itself is always one
:class:`meta.method.prompts.PromptParams` (learn2learn's GBML clones it per task); the learner object it names
(``PromptParams.learner``, a registry key) supplies everything that depends on which tensors θ holds:

* :meth:`PromptLearner.structure_of` / :meth:`PromptLearner.shapes_of`: the structure a
  :class:`meta.method.prompts.PromptSpec` asks for on a CLIP, as init files record it (``prompt`` metadata), and the
  tensors ``{name: [shape]}`` that structure holds, in θ's parameter order (= the order of R_φ in GBML);
* :meth:`PromptLearner.init`: the start tensors (random draws from the caller's generator);
* :meth:`PromptLearner.text_prompts` / :meth:`PromptLearner.visual_prompts`: what the towers receive, read from
  any object carrying the tensors as attributes (θ, its learn2learn clones, a task stack ``[B, ...]`` of
  :mod:`meta.method.batched`), so every leading task dimension must ride along.

Adding a learner is one subclass and one :func:`register_learner` call (plus, for the method table, one row of
``meta/method/methods.yaml``); nothing else in the library names its tensors.  The built-in learner ``clip``
(:class:`meta.method.prompts.ClipPrompts`) covers CoOp, VPT, UNIGRAM, IVLP and MaPLe by its spec fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # torch-free at import: the method table (meta.method.methods) reads DEFAULT_LEARNER without torch
    import torch
    from torch import nn

# The learner a θ without a ``learner`` attribute (and an init file without ``prompt.learner``) is read as.
DEFAULT_LEARNER = "clip"

_REGISTRY: dict[str, "PromptLearner"] = {}


class PromptLearner:
    """How one kind of prompt learner holds θ and prompts CLIP's towers (see the module docstring).

    Subclasses set :attr:`key` and :attr:`tensor_names` and implement the methods below.  ``structure`` dicts
    hold at least ``n_ctx_text`` (M, the context positions of the text prompt, 0 = the fixed template),
    ``n_ctx_vision`` and ``vision_depth`` (free visual tokens), ``text_depth`` and ``coupling`` (what init files
    have always recorded); a learner may add fields of its own.
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
