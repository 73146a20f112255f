"""Dassl-free few-shot adaptation and evaluation (CoOp's base-to-new and transfer protocols).

Public API (the command line, ``python -m meta.evaluation``, is :mod:`meta.evaluation.cli`): what to fine-tune
(:class:`MethodSpec`, :func:`method_preset`) and how (:class:`TrainSpec`), on which data (:class:`DatasetRef`),
the protocols (:func:`evaluate_base_to_new`, :func:`evaluate_transfer`, sharing an :class:`EvaluationSession`,
optionally from an in-memory :class:`StartPoint`) and their seed summaries (:func:`summarise`,
:func:`epoch_curves`).
"""

from meta.evaluation.datasets import DatasetRef
from meta.evaluation.images import FeatureCache, ImageLoader, clip_fingerprint
from meta.evaluation.protocol import EvaluationSession, evaluate_base_to_new, evaluate_transfer
from meta.evaluation.spec import (
    PRESET_ALIASES,
    PRESET_NAMES,
    MethodSpec,
    TrainSpec,
    is_gram_preset,
    method_preset,
    preset_key,
)
from meta.evaluation.summary import epoch_curves, format_row, summarise
from meta.evaluation.training import LabelledSet, PromptTuner, StartPoint, build_prompts, make_optimizer, make_scheduler
from meta.finetune.engine import prompt_digest

__all__ = [
    "DatasetRef",
    "FeatureCache",
    "ImageLoader",
    "clip_fingerprint",
    "EvaluationSession",
    "evaluate_base_to_new",
    "evaluate_transfer",
    "PRESET_NAMES",
    "PRESET_ALIASES",
    "preset_key",
    "is_gram_preset",
    "MethodSpec",
    "TrainSpec",
    "method_preset",
    "LabelledSet",
    "PromptTuner",
    "StartPoint",
    "build_prompts",
    "make_optimizer",
    "make_scheduler",
    "prompt_digest",
    "summarise",
    "epoch_curves",
    "format_row",
]
