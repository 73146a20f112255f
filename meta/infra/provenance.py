"""Where a result came from: the code's git commit (one helper for the demo's report and the Dassl trainers' logs),
and :func:`computed_by`, the record every results file stores (commit, numerics fingerprint, CPU, pins, builds)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional, Union

REPO = Path(__file__).resolve().parents[2]
_FINGERPRINT: dict = {}


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


def numerics_fingerprint() -> str:
    """Digest of the golden run (:mod:`meta.infra.fingerprint`) on this machine and code, computed once per process
    (~15 s on one core).  Results computed under equal digests may be pooled; the committed golden digest is
    what a reproducing machine gives."""
    if "digest" not in _FINGERPRINT:
        from meta.infra.fingerprint import fingerprint

        _FINGERPRINT["digest"] = fingerprint()["digest"]
    return _FINGERPRINT["digest"]


def computed_by(device: Optional[str] = None) -> dict:
    """What computed a result: ``{"commit", "fingerprint", "golden", "numerics"}``.

    ``fingerprint``: :func:`numerics_fingerprint`; ``golden``: whether it equals the committed golden digest
    (``meta/infra/fingerprint_golden.json``); ``numerics``: :func:`meta.infra.numerics.numerics_record` (CPU model and
    kernel flags, pins, threads, package builds; on ``device`` ``cuda`` the card, driver and settings).
    """
    import json

    from meta.infra.fingerprint import GOLDEN
    from meta.infra.numerics import numerics_record

    digest = numerics_fingerprint()
    try:
        golden = json.loads(GOLDEN.read_text())["digest"]
    except (OSError, ValueError, KeyError):
        golden = None
    return {
        "commit": git_commit(REPO),
        "fingerprint": digest,
        "golden": digest == golden,
        "numerics": numerics_record(device),
    }
