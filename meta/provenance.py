"""Where a result came from: the code's git commit (one helper for the demo's report and the Dassl trainers' logs)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Union


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
