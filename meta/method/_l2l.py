"""Import learn2learn quietly, with a one-line fix when it is missing.

learn2learn 0.2.0 imports ``gym`` at import time, which prints a multi-line
deprecation banner to stderr; it carries no information for GRAM users.
"""

from __future__ import annotations

import contextlib
import io

try:
    with contextlib.redirect_stderr(io.StringIO()):
        import learn2learn as l2l  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"learn2learn is not importable ({err}); run `bash scripts/setup.sh`, which builds "
        "learn2learn 0.2.0 from its sdist for Python >= 3.11"
    ) from err

__all__ = ["l2l"]
