"""Where code came from: its git commit (one helper for the demo's report, the Dassl trainers' logs and the record
every results file stores, :func:`meta.fingerprint.record.computed_by`), and :func:`results_record`, the slot through
which the groups below :mod:`meta.fingerprint` write that record without importing the group above them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable, Optional, Union

REPO = Path(__file__).resolve().parents[2]


def git_commit(path: Union[str, Path], length: int = 12) -> str:
    """Short commit of the repository holding ``path`` (``+dirty`` when tracked files differ), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", f"--short={length}", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# meta.fingerprint.record puts its computed_by here when it is imported (python -m meta does, before a command runs):
# the golden run uses every group, so the groups it sits above reach it through this slot, not by an import.
RECORDERS: dict[str, Callable[[Optional[str]], dict]] = {}


def results_record(device: Optional[str] = None) -> dict:
    """What computed a result: :func:`meta.fingerprint.record.computed_by` (commit, numerics fingerprint, CPU, pins,
    builds) where :mod:`meta.fingerprint.record` is loaded, else the same record without the fingerprint."""
    recorder = RECORDERS.get("computed_by")
    if recorder is not None:
        return recorder(device)
    from meta.infra.numerics import numerics_record

    return {"commit": git_commit(REPO), "numerics": numerics_record(device)}
