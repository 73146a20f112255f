"""Measure what an operation copies: bytes written by tensor-producing copy ops.

Used by the benchmark and tests to show that ``GBML.clone()`` copies only θ and
φ per task, never the frozen CLIP weights.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")
_COPY_OPS = {"clone", "_to_copy", "copy_", "empty_like", "contiguous", "detach_copy"}


class _CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _COPY_OPS and isinstance(out, torch.Tensor):
            self.bytes += out.numel() * out.element_size()
        return out


def bytes_copied(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn()`` and return ``(result, bytes produced by clone/copy ops inside it)``."""
    counter = _CopyCounter()
    with counter:
        result = fn()
    return result, counter.bytes
