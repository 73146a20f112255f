"""What a run logs so its numbers can be traced: environment versions and a hash of the data sample.

Users who cannot reproduce CoOp-family numbers usually differ in versions, transforms, seeds or
the few-shot draw (the recurring answer in KaiyangZhou/CoOp's and MaPLe's GitHub issue threads), so every GRAM run
prints these.
"""

from __future__ import annotations

import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Iterable, Optional

from meta.infra.hashing import file_sha256  # noqa: F401  (dassl_trainers imports it from here)
from meta.infra.provenance import git_commit

PACKAGES = ("torch", "torchvision", "open_clip_torch", "dassl", "gram-prompt", "numpy", "yacs")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def environment_summary() -> str:
    """One line: python, platform, package versions, and this code's git commit."""
    parts = [f"python {platform.python_version()}", platform.platform(terse=True)]
    parts += [f"{p} {_version(p)}" for p in PACKAGES]
    parts.append(f"code commit {git_commit(Path(__file__).resolve().parent)}")
    return ", ".join(parts)


def sample_digest(items: Iterable, root: Optional[str] = None) -> tuple[int, str]:
    """``(count, sha256)`` of Dassl ``Datum``-like items (``impath``, ``label``, ``classname``).

    Paths are taken relative to ``root`` (the dataset root) so the same draw hashes the same on
    every machine; order does not matter.
    """
    rows = []
    for d in items:
        path = os.path.abspath(d.impath)
        if root:
            path = os.path.relpath(path, os.path.abspath(os.path.expanduser(root)))
        rows.append(f"{path.replace(os.sep, '/')}\t{int(d.label)}\t{d.classname}")
    rows.sort()
    return len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest()
