"""One writer per output folder: an exclusive ``flock`` on ``<folder>/.lock``.

``python -m meta train`` and ``python -m meta cluster`` hold their folder's lock for the whole run: a second run there
fails at once with ``<folder>: already in use by PID <n>``.  The kernel releases it when the holder exits, even after
``SIGKILL``.  Under ``torchrun`` only rank 0 takes it (``RunLock(folder, enabled=is_rank0())``).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
from pathlib import Path
from typing import Optional, Union

from meta.infra.cli_errors import UserError

LOCK_NAME = ".lock"


def is_rank0() -> bool:
    """True unless torchrun's ``RANK`` says this process is another rank."""
    return int(os.environ.get("RANK", "0") or 0) == 0


class RunLock:
    """Exclusive, non-blocking lock on an output ``folder`` (created if missing); ``key``: the config key or flag
    that named it (for the error when it is not a folder); ``enabled`` False makes every method a no-op (non-zero
    ranks).  Use as a context manager, or :meth:`acquire` / :meth:`release`.  On release the lock file is
    removed; holders verify after locking that the file they locked is still the one on disk,
    so removing it cannot let two writers in.
    """

    def __init__(self, folder: Union[str, os.PathLike], key: str = "", enabled: bool = True):
        self.folder = Path(folder)
        self.key = key
        self.enabled = enabled
        self.path = self.folder / LOCK_NAME
        self.created_folder = False
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _holder(self) -> str:
        try:
            text = self.path.read_text().strip()
        except OSError:
            return "?"
        return text if text.isdigit() else "?"

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`UserError` (folder busy, or the path is a file)."""
        import fcntl

        if not self.enabled or self.held:
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(self.key or str(self.folder), f"{self.folder} is a file, expected a folder")
        if not self.folder.exists():
            try:
                self.folder.mkdir(parents=True)
                self.created_folder = True
            except FileExistsError:
                pass
            except OSError as err:
                raise UserError(self.key or str(self.folder), f"cannot create {self.folder} ({err.strerror})") from None
        for _ in range(20):
            fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno_mod.EWOULDBLOCK, errno_mod.EAGAIN, errno_mod.EACCES):
                    raise UserError(
                        str(self.folder),
                        f"already in use by PID {self._holder()} (one run per "
                        f"output folder; wait for it or choose another folder)",
                    ) from None
                raise
            try:  # the holder before us may have removed the file between our open and our lock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return self
            os.close(fd)
        raise UserError(str(self.folder), "could not lock the folder (its .lock file keeps changing)")

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, exc_type, *exc) -> None:
        """Release; on an exception also delete the folder again if this lock created it and it is still empty
        (a run refused before writing anything leaves no folder behind)."""
        self.release()
        if exc_type is not None and self.created_folder:
            with contextlib.suppress(OSError):
                self.folder.rmdir()
