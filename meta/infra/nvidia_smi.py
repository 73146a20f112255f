"""``nvidia-smi`` queried in CSV: the rows it prints, or ``None`` where it cannot answer (no binary, no driver, a
timeout).  Standard library only: :mod:`meta.infra.numerics` asks it for the driver before torch starts."""

from __future__ import annotations

import subprocess
from typing import Optional


def query(*flags: str, timeout: float = 10.0) -> Optional[list[list[str]]]:
    """Rows of ``nvidia-smi <flags> --format=csv,noheader,nounits``, each split at its commas and stripped (blank
    lines dropped); ``None`` when the command is missing, fails or takes longer than ``timeout`` seconds."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *flags, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return [[cell.strip() for cell in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
