"""On-disk caching that makes every CHC stage resumable.

:class:`StageMarker`: a ``<stage>.done.json`` holding the stage's fingerprint (its settings and upstream fingerprints);
a matching marker skips the stage.  :class:`ChunkedArray`: a ``.npy`` memmap filled chunk by chunk beside a
``.progress.json``, rows flushed before progress advances, so a crash loses at most one chunk.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from meta.chc.errors import DiskSpaceError
from meta.infra.fileio import atomic_path
from meta.infra.fileio import write_json_atomic as _write


def fingerprint(*parts) -> str:
    """Stable 16-hex-digit hash of JSON-serialisable ``parts`` (numpy arrays hashed by bytes)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(str(part.dtype).encode() + str(part.shape).encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def dedupe(strings: Sequence[str]) -> tuple[list, np.ndarray]:
    """Unique strings in first-seen order and int64 ``[n]`` positions into them (dict-based:
    memory grows with the unique strings, not with ``n x longest string`` as numpy unicode would)."""
    first: dict = {}
    inverse = np.fromiter((first.setdefault(s, len(first)) for s in strings), dtype=np.int64, count=len(strings))
    return list(first), inverse


def groups(labels: np.ndarray) -> dict:
    """``{label: sorted int64 indices}`` for labels >= 0, in one sort (not one pass per label)."""
    labels = np.asarray(labels)
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    values, starts = np.unique(sorted_labels, return_index=True)
    ends = np.append(starts[1:], len(order))
    return {int(v): order[a:b] for v, a, b in zip(values, starts, ends) if v >= 0}


def write_json_atomic(path: Path, payload) -> None:
    """Write JSON to ``path`` atomically (:func:`meta.infra.fileio.atomic_path`: no half-written files)."""
    _write(path, payload, indent=1)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """``np.save`` through :func:`meta.infra.fileio.atomic_path`, so a crash never leaves a truncated array."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, array)


def _reserve(path: Path, needed: int) -> None:
    """Allocate every block of ``path`` (``posix_fallocate``); ENOSPC/EDQUOT -> :class:`DiskSpaceError`."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        with open(path, "r+b") as fh:
            os.posix_fallocate(fh.fileno(), 0, os.fstat(fh.fileno()).st_size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # other errors: a filesystem without fallocate
            raise DiskSpaceError(
                f"{path.parent}: needs {needed} bytes for {path.name}, {shutil.disk_usage(path.parent).free} free"
            ) from None


def create_memmap(path: Path, dtype, shape: Sequence[int]) -> np.memmap:
    """A new ``.npy`` memmap whose disk blocks are reserved before any write.

    A mapped write into a sparse file on a full disk is a SIGBUS; so free space is checked, then the file preallocated
    (``posix_fallocate``); either failing raises :class:`~meta.chc.errors.DiskSpaceError`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    header = 128  # .npy v1 header of a plain array (format.open_memmap pads it to a multiple of 64)
    needed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + header
    old = path.stat().st_size if path.is_file() else 0
    free = shutil.disk_usage(path.parent).free
    if needed > free + old:
        raise DiskSpaceError(f"{path.parent}: needs {needed} bytes for {path.name}, {free + old} free")
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        _reserve(path, needed)
    except DiskSpaceError:
        del arr
        path.unlink(missing_ok=True)
        raise
    return arr


def open_memmap_rw(path: Path) -> np.memmap:
    """An existing ``.npy`` as a read-write memmap, its blocks reserved first (a file written sparse
    by an older run would otherwise still SIGBUS on a full disk)."""
    path = Path(path)
    _reserve(path, path.stat().st_size)
    return np.load(path, mmap_mode="r+")


class StageMarker:
    """``<dir>/<name>.done.json``: present and matching = the stage's outputs are valid."""

    def __init__(self, directory: Path, name: str, fp: str):
        self.path = Path(directory) / f"{name}.done.json"
        self.fp = fp

    def is_done(self) -> bool:
        if not self.path.is_file():
            return False
        try:
            return json.loads(self.path.read_text()).get("fingerprint") == self.fp
        except (json.JSONDecodeError, OSError):
            return False

    def mark(self, info: Optional[dict] = None) -> None:
        write_json_atomic(self.path, {"fingerprint": self.fp, "info": info or {}})


class ChunkedArray:
    """A ``[n_rows, *row_shape]`` array of ``dtype`` on disk, computed in resumable chunks: the ``.npy`` memmap
    ``path``, with ``path + '.progress.json'`` tracking the rows done; another fingerprint ``fp`` (of what the rows
    depend on) restarts from row 0."""

    def __init__(self, path: Path, n_rows: int, row_shape: Sequence[int], dtype, fp: str):
        self.path = Path(path)
        self.progress_path = self.path.with_name(self.path.name + ".progress.json")
        self.n_rows = int(n_rows)
        self.row_shape = tuple(int(s) for s in row_shape)
        self.dtype = np.dtype(dtype)
        self.fp = fp

    def rows_done(self) -> int:
        """Rows already on disk from a run with the same fingerprint (0 if none)."""
        if not (self.progress_path.is_file() and self.path.is_file()):
            return 0
        try:
            prog = json.loads(self.progress_path.read_text())
        except (json.JSONDecodeError, OSError):
            return 0
        same = (
            prog.get("fingerprint") == self.fp
            and prog.get("n_rows") == self.n_rows
            and tuple(prog.get("row_shape", ())) == self.row_shape
            and prog.get("dtype") == self.dtype.str
        )
        return int(prog.get("rows_done", 0)) if same else 0

    def _progress(self, rows_done: int) -> None:
        write_json_atomic(
            self.progress_path,
            {
                "fingerprint": self.fp,
                "n_rows": self.n_rows,
                "row_shape": list(self.row_shape),
                "dtype": self.dtype.str,
                "rows_done": int(rows_done),
            },
        )

    def fill(
        self, compute: Callable[[int, int], np.ndarray], chunk_size: int, desc: str = "", disable_progress: bool = False
    ) -> np.memmap:
        """Compute rows ``[start, end)`` with ``compute(start, end)`` for every missing chunk.

        Returns the read-only memmap; chunks start at multiples of ``chunk_size``, so a resumed run computes the same
        chunks (and batches) as an uninterrupted one.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        done = self.rows_done()
        if done == 0 or not self.path.is_file():
            arr = create_memmap(self.path, self.dtype, (self.n_rows, *self.row_shape))
            self._progress(0)
            done = 0
        else:
            arr = open_memmap_rw(self.path)
        chunk_size = max(1, int(chunk_size))
        done -= done % chunk_size if done < self.n_rows else 0
        with tqdm(
            total=self.n_rows, initial=done, desc=desc, unit="row", disable=disable_progress, dynamic_ncols=True
        ) as bar:
            for start in range(done, self.n_rows, chunk_size):
                end = min(start + chunk_size, self.n_rows)
                rows = np.asarray(compute(start, end))
                if rows.shape != (end - start, *self.row_shape):
                    raise ValueError(
                        f"{desc or self.path.name}: chunk [{start},{end}) returned shape "
                        f"{rows.shape}, expected {(end - start, *self.row_shape)}"
                    )
                arr[start:end] = rows
                arr.flush()
                self._progress(end)
                bar.update(end - start)
        del arr
        return np.load(self.path, mmap_mode="r")
