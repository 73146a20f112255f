"""Where code came from: its git commit (one helper for the demo's report, the Dassl trainers' logs and the record
every results file stores, :func:`meta.fingerprint.record.computed_by`), and :func:`results_record`, that record
without the numerics fingerprint (what a command records when its caller hands it no recorder: the fingerprint is
:mod:`meta.fingerprint`'s, a group above this one, and is passed in explicitly by the commands that record it)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional, Union

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


def results_record(device: Optional[str] = None) -> dict:
    """What computed a result, without the numerics fingerprint: ``{"commit", "fingerprint": None, "numerics"}``
    (:func:`meta.fingerprint.record.computed_by` adds the fingerprint; ``python -m meta train`` passes that one)."""
    from meta.infra.numerics import numerics_record

    return {"commit": git_commit(REPO), "fingerprint": None, "numerics": numerics_record(device)}
