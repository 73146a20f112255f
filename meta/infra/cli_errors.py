"""One error convention for every ``python -m meta ...`` command line.

A problem the user can fix (a config key, a file, a folder, the disk) ends the command with
exit status 2 and one line on stderr::

    error: <file or KEY>: <what was expected>

Code raises :class:`UserError` (or a ``ValueError`` / ``KeyError`` / ``OSError`` whose message
already starts with the file or key); :func:`run_cli` turns it into that line.  Anything else
is a bug and keeps its traceback.  ``--debug`` on the command line or ``GRAM_DEBUG=1`` in the
environment re-raises user errors too, with their traceback.
"""

from __future__ import annotations

import errno as errno_mod
import os
import sys
from typing import Callable, Optional, Sequence

EXIT_USER_ERROR = 2
DEBUG_FLAG = "--debug"
DEBUG_ENV = "GRAM_DEBUG"


class UserError(ValueError):
    """A problem with the user's input, named by the file or config key it comes from.

    A ``ValueError``, so callers that already catch bad values keep working."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        self.message = message


def _flat(text: str) -> str:
    return " ".join(str(text).split())


def _os_error_line(err: OSError) -> str:
    where = err.filename if err.filename is not None else ""
    if err.errno == errno_mod.ENOSPC:
        folder = os.path.dirname(os.path.abspath(where)) if where else "the output folder"
        name = f" (writing {os.path.basename(where)})" if where else ""
        return f"{folder}: no space left on device{name}; free some space and run the command again"
    if where and err.strerror:
        return f"{where}: {err.strerror}"
    return _flat(str(err))


def user_error_types() -> tuple:
    """Exception types reported as one line (imported lazily: keeps this module dependency-free)."""
    types: list = [UserError, ValueError, KeyError, OSError]
    try:
        import yaml

        types.append(yaml.YAMLError)
    except ImportError:  # pragma: no cover
        pass
    for module, name in (
        ("meta.metatrain.checkpoint", "CheckpointError"),
        ("meta.metatrain.data", "FeatureMismatchError"),
        ("meta.metatrain.trainer", "RunExistsError"),
        ("meta.chc.text_embed", "DatasetsShadowError"),
    ):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, name):
            types.append(getattr(mod, name))
    return tuple(types)


def one_line(err: BaseException) -> str:
    """The ``<file or KEY>: <what>`` text of a user error, on one line."""
    if isinstance(err, UserError):
        return _flat(str(err))
    if isinstance(err, KeyError):
        return _flat(str(err.args[0]) if err.args else "KeyError")
    if isinstance(err, OSError) and err.errno is not None:
        return _flat(_os_error_line(err))
    return _flat(str(err) or type(err).__name__)


def int_flag_problem(args, minimums: dict) -> str:
    """``--flag: expected an integer >= N, got V`` for the first integer flag of ``args`` (an argparse
    namespace) below its smallest accepted value, ``minimums`` = ``{dest: N}`` (a list flag: each value);
    ``""`` when every one is in range or unset.  Checked before any work, so a count of 0 or a negative
    one is one line, not a traceback after minutes of measuring."""
    for dest, low in minimums.items():
        value = getattr(args, dest)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v < low:
                return f"--{dest.replace('_', '-')}: expected an integer >= {low}, got {v}"
    return ""


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0", "false", "False")


def run_cli(main: Callable[[list[str]], Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """Call ``main(argv)`` (``--debug`` removed) and turn user errors into one ``error:`` line + exit 2.

    Returns ``main``'s return value (``None`` = 0) or :data:`EXIT_USER_ERROR`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        return int(main(argv) or 0)
    except user_error_types() as err:
        if debug:
            raise
        if int(os.environ.get("RANK", "0") or 0) == 0:  # under torchrun every rank meets the same error
            print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USER_ERROR
