"""Checkpoints of the GRAM trainers: Dassl's file layout, contents that ``weights_only=True`` loads.

Layout (Dassl ``save_checkpoint``, torchtools.py L27-74, so CoOp's scripts and ``--load-epoch``
work unchanged): ``<dir>/<name>/model.pth.tar-<epoch>`` plus ``<dir>/<name>/checkpoint`` naming
the last file.  Content::

    {"state_dict": {param name: tensor},      # θ only: ctx [M, d_t] and/or vpt [D, n, d_v]
     "epoch": int (1-based, epochs done), "optimizer": dict | None, "scheduler": dict | None,
     "val_result": float | None, "gram": {...} (trainer, token counts, widths: plain values)}

Only tensors, numbers, strings, lists and dicts: ``torch.load(weights_only=True)`` (torch >= 2.6
default) reads it, unlike Dassl's own checkpoints (``dassl/utils/torchtools.py:load_checkpoint``).
Nothing in ``state_dict`` depends on the class names, so loading a base-class checkpoint for new
classes needs no surgery; keys of CoOp-style class buffers (``token_prefix``/``token_suffix``)
found in foreign checkpoints are dropped.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from meta.infra.dassl_runs import LAST_POINTER, checkpoint_name  # Dassl's names, read by the runner too

CLASS_DEPENDENT_KEYS = ("token_prefix", "token_suffix")  # CoOp coop.py L316-321, MaPLe maple.py L325-329


def checkpoint_file(directory: Union[str, Path], name: str, epoch: Optional[int] = None) -> Path:
    """``<directory>/<name>/model.pth.tar-<epoch>``; without ``epoch`` the file named by the ``checkpoint`` pointer."""
    folder = Path(directory) / name
    if epoch is not None:
        return folder / checkpoint_name(epoch)
    pointer = folder / LAST_POINTER
    if not pointer.is_file():
        raise FileNotFoundError(f"no checkpoint pointer at {pointer} (expected a Dassl-layout output folder)")
    return folder / pointer.read_text().strip().splitlines()[0]


def save_checkpoint(
    directory: Union[str, Path],
    name: str,
    epoch: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    val_result: Optional[float] = None,
    extra: Optional[Mapping[str, Any]] = None,
    filename: str = "",
) -> Path:
    """Write one registered model's checkpoint (``epoch`` = epochs completed, 1-based) and its pointer."""
    folder = Path(directory) / name
    folder.mkdir(parents=True, exist_ok=True)
    state = OrderedDict(
        (k[7:] if k.startswith("module.") else k, v.detach().cpu()) for k, v in model.state_dict().items()
    )
    payload = {
        "state_dict": state,
        "epoch": int(epoch),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "val_result": None if val_result is None else float(val_result),
        "gram": dict(extra or {}),
    }
    path = folder / (filename or checkpoint_name(epoch))
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, str(tmp))
    os.replace(tmp, path)
    (folder / LAST_POINTER).write_text(path.name + "\n")
    return path


def load_checkpoint(path: Union[str, Path]) -> dict:
    """Read a checkpoint with ``weights_only=True`` on CPU; a one-line error for missing or unsafe files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model checkpoint at {path}")
    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle.UnpicklingError for Dassl's own checkpoints, among others
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(
            f"{path} is not a weights-only checkpoint ({first}); was it written by a GRAM trainer?"
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise RuntimeError(f"{path}: expected a dict with a 'state_dict' entry")
    return ckpt


def prompt_state(state_dict: Mapping[str, torch.Tensor], model: nn.Module, source: str = "") -> dict:
    """The entries of ``state_dict`` that ``model`` owns, with class-dependent buffers dropped.

    Raises a one-line error naming the missing keys or mismatching shapes.
    """
    own = model.state_dict()
    kept, problems, seen = {}, [], set()
    for key, value in state_dict.items():
        key = key[7:] if key.startswith("module.") else key
        seen.add(key)
        if key.split(".")[-1] in CLASS_DEPENDENT_KEYS:
            continue
        if key not in own:
            problems.append(f"unexpected key {key}")
        elif tuple(own[key].shape) != tuple(value.shape):
            problems.append(f"{key}: checkpoint {tuple(value.shape)}, model {tuple(own[key].shape)}")
        else:
            kept[key] = value
    problems += [f"missing key {k}" for k in own if k not in seen]  # a key of the wrong shape is named once, above
    if problems:
        raise RuntimeError(f"{source or 'checkpoint'} does not fit this model: " + "; ".join(problems))
    return kept
