"""A GRAM trainer's check that fails in an unchanged fork's ``train.py`` ends in one line, not a traceback.

Stock CoOp-family ``train.py`` scripts call ``build_trainer(cfg)`` without catching anything, so a bad key found by
``check_cfg`` (before any data is read) would print a traceback around its one-line message.  :func:`as_one_line`
marks such an error and installs (once) a ``sys.excepthook`` that prints ``error: <message>`` for a marked
exception left uncaught at the top level and hands every other exception to the hook that was there before.  The
exception itself is unchanged: code that catches it (tests, our own ``train.py``) sees the same type and message.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Optional

_MARK = "_gram_one_line"


def _hook(previous):
    def excepthook(kind: type, value: BaseException, tb: Optional[TracebackType]) -> None:
        if getattr(value, _MARK, False):
            print(f"error: {value}", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    excepthook.gram_one_line = True  # type: ignore[attr-defined]
    return excepthook


def as_one_line(err: BaseException) -> BaseException:
    """Mark ``err`` (a one-line input error) to be printed as ``error: <message>`` when nothing catches it."""
    setattr(err, _MARK, True)
    if not getattr(sys.excepthook, "gram_one_line", False):
        sys.excepthook = _hook(sys.excepthook)
    return err
