"""Content hashes shared by CHC, meta-training and the trainers' provenance logs."""

from __future__ import annotations

import hashlib
import os
from typing import Union


def file_sha256(path: Union[str, os.PathLike]) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
