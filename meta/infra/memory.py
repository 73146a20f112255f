"""The process's resident memory on Linux: its high-water mark during one call (proc(5): writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM`` in ``/proc/self/status`` to the current ``VmRSS``; Linux >= 4.0)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_hwm() -> bool:
    """Reset ``VmHWM`` to the current resident size; False where the kernel offers no way (not Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_mib(fn: Callable[[], T]) -> tuple[T, Optional[float]]:
    """``(fn(), MiB)``: the resident high-water mark during ``fn()`` above the resident size just before it, or
    ``None`` for the MiB where ``VmHWM`` cannot be reset (resident bytes: what the allocator kept, not what tensors
    hold)."""
    if not reset_hwm():
        return fn(), None
    before = status_kib("VmRSS")
    out = fn()
    return out, (status_kib("VmHWM") - before) / 1024
