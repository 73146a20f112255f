"""Worker processes that die with the process that started them, and build folders whose owner is known.

A ``kill -9`` of ``python -m gram_world.demo`` (or of a world build) gives its worker processes no chance to
be told: a pool worker blocked on its task queue, or busy on a task, would live on with parent 1, holding
its memory.  :func:`die_with_parent` is the workers' initializer: on Linux it asks the kernel to SIGKILL the
worker when its parent dies (``prctl(PR_SET_PDEATHSIG)`` through ctypes), and everywhere it starts a daemon
thread that polls ``os.getppid()`` every :data:`POLL_SECONDS` and ends the worker once the parent is gone.

Build folders (``.<name>.partial-<pid>-<hex>``) carry their writer's process id and hold an ``flock`` on
``<folder>/.building`` while the writer lives: :func:`partial_is_stale` says when such a folder's writer is gone
(no process with that id, or the id reused by a process that does not hold the lock).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: liveness by process id only
    fcntl = None

POLL_SECONDS = 0.5
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LOCK_NAME = ".building"
_PARTIAL_RE = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)-(?P<tag>[0-9a-f]+)$")


def _parent_gone(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


def _watch(parent_pid: int, poll_seconds: float) -> None:
    while True:
        time.sleep(poll_seconds)
        if _parent_gone(parent_pid):
            os._exit(1)


def die_with_parent(
    parent_pid: int, initializer: Optional[Callable] = None, initargs: tuple = (), poll_seconds: float = POLL_SECONDS
) -> None:
    """Make this (worker) process end when process ``parent_pid`` dies, then run ``initializer(*initargs)``.

    Use as a pool's initializer with ``initargs=(os.getpid(), ...)`` taken in the parent.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc symbol: the watch thread alone
            pass
    if _parent_gone(parent_pid):  # the parent died before the request above was in place
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid, poll_seconds), name="parent-death-watch", daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


# --------------------------------------------------------------------------- partial build folders
def partial_name(name: str) -> str:
    """``.<name>.partial-<this pid>-<8 hex>``: a build folder that names its writer."""
    return f".{name}.partial-{os.getpid()}-{os.urandom(4).hex()}"


def lock_partial(folder: Path) -> Optional[IO]:
    """Hold ``folder/.building`` locked while this process writes ``folder``; returns the open file (keep it)."""
    if fcntl is None:
        return None
    fh = open(folder / LOCK_NAME, "w")
    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fh


def release_partial(folder: Path, fh: Optional[IO]) -> None:
    """Drop the lock file before ``folder`` is renamed into place (a finished folder carries no lock)."""
    if fh is not None:
        fh.close()
    try:
        (folder / LOCK_NAME).unlink()
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    from meta.infra.fileio import pid_alive

    return pid_alive(pid)


def partial_is_stale(folder: Path) -> bool:
    """True when ``folder`` (named by :func:`partial_name`) has no living writer."""
    m = _PARTIAL_RE.match(folder.name)
    if m is None:
        return False  # not ours to judge (another naming, e.g. an older build): left alone
    if not _pid_alive(int(m["pid"])):
        return True
    lock = folder / LOCK_NAME
    if fcntl is None or not lock.is_file():
        return False  # a live process with that id, still creating the folder (or no locks here)
    try:
        with open(lock, "r") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # acquired: nobody holds it, the id was reused
        return True
    except OSError:
        return False


def clean_stale_partials(parent: Path) -> list[Path]:
    """Remove ``parent``'s partial build folders whose writer is gone; returns those removed."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink() and partial_is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed
