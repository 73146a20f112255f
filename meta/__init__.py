"""GRAM core: prompt learners over open_clip, the gradient regulator, meta-learning.

The public API, what README's "core in five lines" uses::

    import meta
    clip, dims = meta.load_clip("ViT-B-16", pretrained=None)
    theta = meta.PromptParams.from_spec(meta.PromptSpec(n_ctx_text=4), clip, dims)
    learner = meta.GRAMMetaLearner(theta, meta.MetaSpec(inner_lr=0.1))
    outer = meta.OuterStep(learner)   # outer.meta_step(tasks, loss_fn): one update of θ and φ

Names are resolved on first use (PEP 562 ``__getattr__``, :data:`_EXPORTS`), so ``import meta`` imports no torch;
sub-packages are imported by their own names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# module -> the public names it defines
_MODULES = {
    "meta.model.backbone": "load_clip ClipDims",  # frozen CLIP (open_clip)
    "meta.method.prompts": "PromptSpec PromptParams PromptedCLIP classification_loss",  # θ: prompt learners
    "meta.method.regulator": "RegulatorSpec GradientRegulator RegulatorFactory",  # φ: the gradient regulator
    "meta.method.gram": "GRAMMetaLearner MetaSpec TaskBatch",  # the bi-level meta-learner
    "meta.metatrain.outer": "OuterStep",  # the outer update of θ and φ (meta-training's optimiser step)
    "meta.finetune.regulated": "GradientRegulation finetune_and_score",  # test-time use of φ
    # the fine-tuning engine shared by the Dassl trainers and the evaluator
    "meta.finetune.engine": "StartSpec build_start RegulatedStepper",
    # init files (θ*, φ) for the trainers and stock CoOp
    "meta.finetune.init_io": "GramInit InitMismatchError export_gram_init load_gram_init export_coop_context",
}
# public name -> module that defines it
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names.split()}

__all__ = [*sorted(_EXPORTS), "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names come from __getattr__
    # ruff: noqa: F401 (the names __all__ exports, read from _EXPORTS)
    from meta.finetune.engine import RegulatedStepper, StartSpec, build_start
    from meta.finetune.init_io import GramInit, InitMismatchError, export_coop_context, export_gram_init, load_gram_init
    from meta.finetune.regulated import GradientRegulation, finetune_and_score
    from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
    from meta.method.regulator import GradientRegulator, RegulatorFactory, RegulatorSpec
    from meta.model.backbone import ClipDims, load_clip


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meta' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))
