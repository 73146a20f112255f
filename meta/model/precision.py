"""Mixed precision on CUDA: which autocast dtype a config asks for, and what runs where.

Config keys: ``META.AUTOCAST`` (meta-training forward passes) and ``CHC.IMAGES.AUTOCAST`` (CLIP
image features in CHC), each ``none | bf16 | fp16``; ``MODEL.PRECISION`` is the dtype of the
frozen CLIP's weights; ``MODEL.TF32`` lets fp32 matmuls on CUDA use TF32 (:func:`apply_tf32`).  Autocast is a CUDA
feature here: on a CPU the run keeps fp32 and says so in one log line per key (never a warning per step), and
``MODEL.PRECISION fp16`` falls back to fp32 the same way (fp16 matmuls on CPUs are slow or missing).
"""

from __future__ import annotations

import contextlib
import logging
from typing import ContextManager, Union

import torch

log = logging.getLogger("meta.model.precision")

AUTOCAST_MODES = ("none", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DASSL_PRECISIONS = ("fp16", "fp32", "amp")  # CoOp's TRAINER.<NAME>.PREC values
_said: set = set()


def say_once(message: str) -> None:
    """Log ``message`` (level WARNING, logger ``meta.model.precision``) the first time only."""
    if message not in _said:
        _said.add(message)
        log.warning(message)


def _device_type(device: Union[str, torch.device]) -> str:
    return torch.device(device).type


def check_autocast(mode: str, key: str) -> str:
    """``mode`` if it is one of :data:`AUTOCAST_MODES`, else a one-line ``ValueError`` naming ``key``."""
    if mode not in AUTOCAST_MODES:
        raise ValueError(f"{key}: expected {' | '.join(AUTOCAST_MODES)}, got {mode!r}")
    return mode


def resolve_autocast(mode: str, device: Union[str, torch.device], key: str) -> str:
    """The autocast mode that runs on ``device``: ``mode`` on CUDA, ``"none"`` elsewhere (logged once)."""
    check_autocast(mode, key)
    if mode != "none" and _device_type(device) != "cuda":
        say_once(f"{key} {mode}: no CUDA device ({device}); running fp32")
        return "none"
    return mode


def resolve_weights(precision: str, device: Union[str, torch.device], key: str = "MODEL.PRECISION") -> str:
    """CLIP weight precision for ``device``: ``fp16`` becomes ``fp32`` off CUDA (logged once)."""
    if precision == "fp16" and _device_type(device) != "cuda":
        say_once(f"{key} fp16: no CUDA device ({device}); running fp32")
        return "fp32"
    return precision


def resolve_precision(prec: str, device_type: str, key: str = "TRAINER.GRAM.PREC") -> str:
    """A Dassl trainer's ``PREC`` (CoOp's fp16 | fp32 | amp) for this device: CPU always gets fp32 (fp16 there is
    5-7x slower, amp a no-op).  No warning: the trainer prints the effective values in one line."""
    if prec not in DASSL_PRECISIONS:
        raise ValueError(f"{key}: expected one of {'|'.join(DASSL_PRECISIONS)}, got {prec!r}")
    return prec if device_type == "cuda" else "fp32"


def autocast(mode: str, device: Union[str, torch.device]) -> ContextManager:
    """``torch.autocast`` for a resolved ``mode`` (a no-op context for ``"none"``)."""
    if mode == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device_type(device), dtype=DTYPES[mode])


def apply_tf32(allow: bool, device: Union[str, torch.device], key: str = "MODEL.TF32") -> bool:
    """Let fp32 matmuls on CUDA use TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``) when ``allow``; off
    otherwise (PyTorch's default: full fp32).  Set for the process when ``device`` is CUDA; a CPU run has no TF32 and
    says so once when asked.  ``allow`` must be a bool (one-line ``ValueError`` naming ``key``).  Returns the flag in
    force for ``device``'s matmuls."""
    if not isinstance(allow, bool):
        raise ValueError(f"{key}: expected True or False, got {allow!r}")
    if _device_type(device) != "cuda":
        if allow:
            say_once(f"{key} True: TF32 is a CUDA feature; this CPU run keeps full fp32 matmuls")
        return False
    torch.backends.cuda.matmul.allow_tf32 = allow
    return allow
