"""Everything a Dassl run writes to stderr also in the run's ``log.txt``.

Dassl's ``setup_logger`` (``dassl/utils/logger.py``) replaces ``sys.stdout`` by a ``Logger`` that writes each message
to the console and to ``OUTPUT_DIR/log.txt``; ``sys.stderr`` stays as it was.  So Python's warnings (the
``warnings`` module writes to ``sys.stderr``), the ``warning: ...`` lines of this repository (fewer images than
``DATASET.NUM_SHOTS``, images over the size caps) and a final ``error: ...`` line reached the terminal but not the
log kept next to the numbers.  :func:`log_stderr` wraps ``sys.stderr`` once: each write goes to the stream as before
*and* into the log file of the Dassl ``Logger`` that is ``sys.stdout`` at that moment (nothing while there is none).
The GRAM trainers install it first thing in ``check_cfg``, so a fork's unchanged ``train.py`` gets it too.
"""

from __future__ import annotations

import sys


def dassl_log_file():
    """The open log file of the Dassl ``Logger`` that is ``sys.stdout`` now; ``None`` when there is none."""
    try:
        from dassl.utils.logger import Logger
    except ImportError:
        return None
    out = sys.stdout
    log = getattr(out, "file", None) if isinstance(out, Logger) else None
    return log if log is not None and not log.closed else None


class StderrToLog:
    """A text stream that writes to ``stream`` and copies each write into :func:`dassl_log_file`."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str):
        written = self.stream.write(text)
        log = dassl_log_file()
        if log is not None and text:
            try:
                log.write(text)
            except (OSError, ValueError):  # the log's disk is full or the file was closed: the terminal still has it
                pass
        return written

    def flush(self) -> None:
        self.stream.flush()
        log = dassl_log_file()
        if log is not None:
            try:
                log.flush()
            except (OSError, ValueError):
                pass

    def __getattr__(self, name: str):  # encoding, isatty, fileno, ... of the wrapped stream
        return getattr(self.stream, name)


def log_stderr() -> None:
    """Copy ``sys.stderr`` into the Dassl log from now on (:class:`StderrToLog`); a second call does nothing."""
    if not isinstance(sys.stderr, StderrToLog):
        sys.stderr = StderrToLog(sys.stderr)
