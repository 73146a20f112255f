"""Dassl-free few-shot adaptation and evaluation (CoOp's base-to-new and transfer protocols).

Public API (the command line, ``python -m meta.evaluation``, is :mod:`meta.evaluation.cli`):

* :class:`MethodSpec`, :func:`method_preset` - what to fine-tune (zero-shot CLIP, CoOp, VPT,
  UNIGRAM, with or without a GRAM init file and its gradient regulator);
* :class:`TrainSpec` - CoCoOp's schedule by default (SGD 0.002, 10 epochs, batch 1, cosine with
  one constant warm-up epoch), augmentation and evaluation cadence;
* :class:`DatasetRef` - a CoOp-layout dataset (read through ``meta.data.coop_data``);
* :func:`evaluate_base_to_new`, :func:`evaluate_transfer` -> JSON-able result records;
* :class:`EvaluationSession` - shares frozen image features between runs;
* :func:`summarise`, :func:`epoch_curves` - seed means (± population
  std, as CoOp's parser), H of the means, accuracy-vs-epoch curves;
* :class:`StartPoint` - fine-tune from in-memory θ/φ (meta-validation of live meta-parameters).
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
