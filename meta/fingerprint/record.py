"""What computed a result: :func:`computed_by`, the record every results file stores (commit, numerics fingerprint,
CPU, pins, builds), and :func:`numerics_fingerprint`, this machine's digest of the golden run
(:mod:`meta.fingerprint.golden`)."""

from __future__ import annotations

from typing import Optional

from meta.infra.provenance import REPO, git_commit

_FINGERPRINT: dict = {}


def numerics_fingerprint() -> str:
    """Digest of the golden run (:mod:`meta.fingerprint.golden`) on this machine and code, computed once per process
    (~15 s on one core).  Results computed under equal digests may be pooled; the committed golden digest is
    what a reproducing machine gives."""
    if "digest" not in _FINGERPRINT:
        from meta.fingerprint.golden import fingerprint

        _FINGERPRINT["digest"] = fingerprint()["digest"]
    return _FINGERPRINT["digest"]


def computed_by(device: Optional[str] = None) -> dict:
    """What computed a result: ``{"commit", "fingerprint", "golden", "numerics"}``.

    ``fingerprint``: :func:`numerics_fingerprint`; ``golden``: whether it equals the committed golden digest
    (``meta/fingerprint/golden.json``); ``numerics``: :func:`meta.infra.numerics.numerics_record` (CPU model and
    kernel flags, pins, threads, package builds; on ``device`` ``cuda`` the card, driver and settings).
    """
    import json

    from meta.fingerprint.golden import GOLDEN
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
