"""Where code came from: its git commit (one helper for the demo's report, the Dassl trainers' logs and the record
every results file stores, :func:`meta.fingerprint.record.computed_by`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Union

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
