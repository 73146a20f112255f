"""Resumable training state: atomic checkpoint files loadable with ``torch.load(weights_only=True)``.

A checkpoint is one ``checkpoint.pt`` in the run directory holding only plain containers,
numbers, strings and tensors:

* ``format``: :data:`FORMAT`, ``step``: outer steps completed, ``steps_total``: META.STEPS then;
* ``learner``: :meth:`meta.method.gram.GRAMMetaLearner.state` (θ and φ state dicts, optimiser state, counters);
* ``rng``: python ``random``, numpy's global generator, torch CPU (and CUDA) generators
  (see :func:`capture_rng`); ``stream``: the task/batch stream's position and generator state;
* under torchrun also ``rng_ranks`` (every rank's :func:`capture_rng`) and ``world_size``; rank 0 writes the file;
* ``config``: the result-defining flattened config and its hash; ``hierarchy``: the task source's fingerprint.

Writes are atomic (:mod:`meta.infra.fileio`): a kill leaves the previous or the new checkpoint.
"""

from __future__ import annotations

import io
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from meta.infra.fileio import MAX_NESTING, nesting_depth_exceeds, write_bytes_atomic

FORMAT = "gram-metatrain-checkpoint/1"
CHECKPOINT_NAME = "checkpoint.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, or that belongs to a different run."""


# ----------------------------------------------------------------------------- RNG states
def _numpy_global_state() -> dict:
    state = np.random.get_state(legacy=False)
    return {
        "bit_generator": state["bit_generator"],
        "key": torch.from_numpy(state["state"]["key"].astype(np.int64)),
        "pos": int(state["state"]["pos"]),
        "has_gauss": int(state["has_gauss"]),
        "gauss": float(state["gauss"]),
    }


def _set_numpy_global_state(s: dict) -> None:
    state = {"key": s["key"].numpy().astype(np.uint32), "pos": int(s["pos"])}
    gauss = {"has_gauss": int(s["has_gauss"]), "gauss": float(s["gauss"])}
    np.random.set_state({"bit_generator": s["bit_generator"], "state": state, **gauss})


def capture_rng() -> dict:
    """The global random states (python, numpy, torch, CUDA) as tensors / lists / ints (weights_only-safe).

    The task/batch stream keeps its own generator; its state is saved next to this one
    (``meta.metatrain.tasks.TaskStream.state()``: a numpy PCG64 state, i.e. a dict of python ints).
    """
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": {"version": int(version), "internal": list(internal), "gauss": gauss},
        "numpy": _numpy_global_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return out


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng` (CUDA states only when the devices are present)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    _set_numpy_global_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- files
def save_checkpoint(path: Union[str, Path], payload: dict) -> Path:
    """Write ``payload`` atomically (:func:`meta.infra.fileio.write_bytes_atomic`: temp file, fsync, rename).

    The archive is built in memory first (a few MB: prompts, regulators, optimiser moments), so a
    full disk surfaces as one ``OSError`` naming the checkpoint, not as a torch writer error.
    """
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **payload}, buffer)
    return write_bytes_atomic(path, buffer.getvalue())


def load_checkpoint(path: Union[str, Path]) -> dict:
    """Read a checkpoint with ``weights_only=True``; :class:`CheckpointError` (one line) if unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: unreadable checkpoint (not a complete torch archive: truncated or corrupt); "
            f"it was left untouched - move it away to start the run over"
        )
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        # RecursionError is a RuntimeError: a pickle nested too deeply for the unpickler lands here too
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({first}); it was left untouched - move it away to start the run over"
        ) from None
    if nesting_depth_exceeds(state, MAX_NESTING):  # what save_checkpoint writes nests < 10 levels
        raise CheckpointError(
            f"{path}: not a meta-training checkpoint (containers nested deeper than {MAX_NESTING} "
            f"levels); it was left untouched - move it away to start the run over"
        )
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else state
        shown = repr(found) if isinstance(found, str) else f"a {type(found).__name__}"  # never repr a structure
        raise CheckpointError(f"{path}: not a meta-training checkpoint (format {shown[:80]}, expected {FORMAT!r})")
    for key in ("step", "learner", "rng", "stream", "config", "config_hash"):
        if key not in state:
            raise CheckpointError(f"{path}: checkpoint lacks {key!r} (truncated or from another tool)")
    return state
