"""Atomic file writes and the clean-up of what a killed writer leaves behind.

Every output a run promises is written through :func:`atomic_path`: a temporary ``.<name>.tmp-<pid>-<random hex>``
in the target's folder, fsync'ed, given ``0666 & ~umask`` and renamed over the target (folder fsync'ed too), so a kill
leaves the old file or the new one, plus at most a temporary file :func:`clean_stale_temps` removes at the next start.
Write errors surface as ``OSError`` carrying the target's path (one line: :mod:`meta.infra.cli_errors`).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterator, Optional, Union

PathLike = Union[str, os.PathLike]

# .<name>.tmp-<pid> (older writers) or .<name>.tmp-<pid>-<hex> (this module)
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)(?:-[0-9a-f]+)?$")


def temp_name(path: PathLike) -> Path:
    """A fresh temporary path next to ``path``: ``.<name>.tmp-<pid>-<8 hex>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would race with other threads)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: PathLike) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: PathLike) -> None:
    """Make a rename in ``folder`` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        _fsync(folder)


def _with_path(err: OSError, path: Path) -> OSError:
    """``err`` re-raised with the target path as its filename (ENOSPC from write() has none)."""
    if err.errno is None:
        return OSError(errno_mod.EIO, str(err), str(path))
    return OSError(err.errno, err.strerror or os.strerror(err.errno), str(path))


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on success it replaces ``path``.

    The caller writes the complete file at the yielded path (any writer taking a file name).
    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno_mod.EISDIR, "is a folder, expected a file path", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        _fsync(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as err:
        raise _with_path(err, path) from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(path.parent)


def write_bytes_atomic(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``Path(path)``."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
    return path


def write_text_atomic(path: PathLike, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: PathLike, payload: Any, indent: Optional[int] = 2) -> Path:
    """``json.dumps(payload, indent, sort_keys=True, default=str)`` + newline, written atomically."""
    return write_text_atomic(path, json.dumps(payload, indent=indent, sort_keys=True, default=str) + "\n")


# Deepest nesting of JSON or of a loaded checkpoint that readers accept; what this code writes stays under 10.
MAX_NESTING = 64


def nesting_depth_exceeds(obj: Any, limit: int = MAX_NESTING) -> bool:
    """True when dicts / lists / tuples in ``obj`` nest deeper than ``limit`` (walked without recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, (list, tuple)):
            children = list(node)
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(text: Union[str, bytes], limit: int = MAX_NESTING) -> Any:
    """``json.loads`` that refuses nesting deeper than ``limit`` with a ``ValueError``, never a ``RecursionError``.

    Malformed JSON raises ``json.JSONDecodeError`` (a ``ValueError``) as before; callers name the file.
    """
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {limit} levels") from None
    if nesting_depth_exceeds(obj, limit):
        raise ValueError(f"JSON nested deeper than {limit} levels")
    return obj


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(folder: PathLike, all_pids: bool = False) -> list[Path]:
    """Remove temporary files of :func:`atomic_path` (and older ``.<name>.tmp-<pid>`` ones) in ``folder``.

    Only files whose writer process is gone are removed, unless ``all_pids`` (use it when the
    folder's :class:`meta.infra.runlock.RunLock` is held: then no other writer can be active there).
    Not recursive.  Returns the paths removed.
    """
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = _TEMP_RE.match(entry.name)
        if not match or not entry.is_file():
            continue
        pid = int(match.group("pid"))
        if all_pids and pid != os.getpid() or not pid_alive(pid):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed
