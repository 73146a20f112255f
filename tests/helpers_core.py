"""Helpers shared by several test files (import them from here, never from a test file)."""
from __future__ import annotations

from typing import Any

import torch
from yacs.config import CfgNode as CN


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten nested dicts / lists / tuples (state dicts, checkpoints) into ``{path: tensor}``."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}"))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """``a`` and ``b`` hold the same, non-empty set of keys and bit-identical tensors under each."""
    assert a, "nothing to compare: the first state holds no tensors"
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def optim_cfg(**overrides) -> CN:
    """Dassl's OPTIM defaults for the keys schedules read, with CoCoOp's schedule on top."""
    cfg = CN()
    cfg.LR = 0.002
    cfg.LR_SCHEDULER = "cosine"
    cfg.MAX_EPOCH = 10
    cfg.STEPSIZE = (-1,)
    cfg.GAMMA = 0.1
    cfg.WARMUP_EPOCH = 1
    cfg.WARMUP_TYPE = "constant"
    cfg.WARMUP_CONS_LR = 1e-5
    cfg.WARMUP_MIN_LR = 1e-5
    cfg.WARMUP_RECOUNT = True
    for k, v in overrides.items():
        cfg[k] = v
    return cfg
