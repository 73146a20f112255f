"""Reading back what a CHC run wrote, with one-line errors that name the file and what was expected.

A file garbled or cut after it was written would otherwise end a resumed run or ``python -m meta train`` in a bare
decoder message; these readers raise :class:`OutputError`: ``<file>: <what is wrong>; expected <what the file
holds>``, plus how to get a good copy back.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Optional

import numpy as np

from meta.infra.fileio import parse_json


class OutputError(ValueError):
    """A CHC output file cannot be read back or does not hold what the run wrote there."""


def _fix(path: Path, stage: Optional[str]) -> str:
    """How to get a good copy back: rerun (files every run rewrites), or rerun the stage that wrote it."""
    if not stage:
        return "rerun `python -m meta cluster` with the same config to write it again"
    out = path.parent.parent if path.parent.name == stage else path.parent
    return f"delete {out / (stage + '.done.json')} and rerun `python -m meta cluster` to recompute it"


def read_json_output(path, expected: str, stage: Optional[str] = None):
    """The JSON value in ``path``; :class:`OutputError` when it is not valid JSON, naming what it holds
    (``expected``) and the ``stage`` that wrote it (``None`` = a file every run rewrites)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected {expected}; {_fix(path, stage)}")
    try:
        return parse_json(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as err:
        what = f"not valid JSON ({err.msg}: line {err.lineno} column {err.colno})"
    except UnicodeDecodeError:
        what = "not UTF-8 text"
    except ValueError:  # nested deeper than meta.infra.fileio.MAX_NESTING
        what = "JSON nested too deep to read"
    raise OutputError(f"{path}: {what}; expected {expected}; {_fix(path, stage)}")


def load_npy_output(
    path,
    expected: str,
    stage: Optional[str] = None,
    dtype=None,
    ndim: Optional[int] = None,
    rows: Optional[int] = None,
    mmap: bool = False,
) -> np.ndarray:
    """The ``.npy`` array in ``path``, checked; :class:`OutputError` when it is cut, garbled or of another shape.

    ``expected``: what it holds (``"float32 [N, D] CLIP image features"``); ``dtype`` / ``ndim`` / ``rows``: checks
    of its dtype, number of dimensions, first dimension; ``mmap``: memory-map it read-only.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; expected {expected}; {_fix(path, stage)}")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError, pickle.UnpicklingError) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise OutputError(
            f"{path}: truncated or not a .npy array ({text}); expected {expected}; {_fix(path, stage)}"
        ) from None
    problems = []
    if dtype is not None and arr.dtype != np.dtype(dtype):
        problems.append(f"dtype {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        problems.append(f"{arr.ndim} dimensions")
    elif rows is not None and (arr.ndim == 0 or arr.shape[0] != rows):
        problems.append(f"{arr.shape[0] if arr.ndim else 0} rows, not {rows}")
    if problems:
        raise OutputError(
            f"{path}: holds shape {tuple(arr.shape)}, {', '.join(problems)}; expected {expected}; {_fix(path, stage)}"
        )
    return arr


def load_image_features(out_dir, n: int) -> np.ndarray:
    """``<CHC.OUTPUT_DIR>/image_features/image_features.npy``: float32 ``[n, D]`` CLIP image features, memory-mapped
    and checked (:func:`load_npy_output`)."""
    path = Path(out_dir) / "image_features" / "image_features.npy"
    return load_npy_output(path, f"float32 [{n}, D] CLIP image features", "image_features", np.float32, 2, n, mmap=True)


def load_index(directory):
    """:meth:`meta.chc.sources.PairIndex.load` of ``<CHC.OUTPUT_DIR>/index``; :class:`OutputError` when
    one of its files is garbled, cut or disagrees with the others on the number of pairs."""
    import zipfile

    from meta.chc.sources import PairIndex

    directory = Path(directory)
    fix = _fix(directory / "sources.json", "index")
    try:
        index = PairIndex.load(directory)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err.filename or directory}: not found; expected the pair index; {fix}") from None
    except (ValueError, OSError, EOFError, KeyError, TypeError, RecursionError, zipfile.BadZipFile) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise OutputError(
            f"{directory}: pair index unreadable ({type(err).__name__}: {text}); expected "
            f"sources.json, items.npz and items.jsonl as `python -m meta cluster` writes them; {fix}"
        ) from None
    n = len(index.captions)
    if not (len(index.item_source) == len(index.item_offset) == len(index.item_size) == n):
        raise OutputError(
            f"{directory}: items.jsonl holds {n} pairs, items.npz {len(index.item_source)}; "
            f"expected the same number; {fix}"
        )
    return index
