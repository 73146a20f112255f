"""Errors a CHC run reports as one line (``error: <file or KEY>: <what>``, exit 2) instead of a traceback."""

from __future__ import annotations


class InputError(ValueError):
    """The inputs cannot give a usable run (no readable pair, a wrong image root, a broken manifest).

    The message names the file and/or the ``CHC.INPUT.*`` key that sets it.
    """


class DiskSpaceError(OSError):
    """Not enough free disk space for a file the run is about to create (message: folder, bytes needed, free)."""
