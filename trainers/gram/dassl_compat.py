"""Let a fork's *stock* Dassl trainers (CoOp, CoCoOp) train and evaluate on torch >= 2.6, unchanged Dassl.

Import it once in the fork's ``train.py`` (anywhere among the imports)::

    import trainers.gram.dassl_compat  # noqa: F401

It patches Dassl.pytorch @ c61a1b5 in memory; no Dassl file is edited:

1. ``dassl.optim.lr_scheduler``'s warm-up schedulers passed ``verbose`` to ``LRScheduler.__init__``,
   a ``TypeError`` on torch >= 2.7 while the model is built (even for ``--eval-only``).  Their
   ``__init__`` now leaves it out.
2. Their ``state_dict`` pickled the successor scheduler *object*, so Dassl's own checkpoints did not
   load under torch's ``weights_only=True`` default (torch >= 2.6: ``Unsupported global:
   torch.optim.lr_scheduler.CosineAnnealingLR``).  The successor is now saved as its own state
   dict, and ``load_state_dict`` accepts both forms.  Checkpoints written *before* this import still
   hold the object: :func:`load_checkpoint` then raises a one-line error saying so.
3. ``MODEL.INIT_WEIGHTS`` (``dassl.utils.load_pretrained_weights``) skipped tensors whose shape
   differs with only a ``UserWarning: Cannot load``, so a GRAM context exported with 4 vectors
   silently trained a random 16-vector context when ``TRAINER.COOP.N_CTX 4`` was forgotten.  It now
   raises a one-line ``ValueError`` naming the key, both shapes and, for ``ctx``, the N_CTX to set.

The same function objects are also replaced in every already-imported module that holds them
(``trainers.coop`` imports them by name), so the import order does not matter.
"""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict
from typing import Any

import torch
from dassl.optim import lr_scheduler as _dassl_sched
from dassl.utils import torchtools as _torchtools
from torch.optim.lr_scheduler import LRScheduler

_ORIGINAL_LOAD_PRETRAINED = getattr(
    _torchtools.load_pretrained_weights, "_gram_original", _torchtools.load_pretrained_weights
)
_ORIGINAL_LOAD_CHECKPOINT = getattr(_torchtools.load_checkpoint, "_gram_original", _torchtools.load_checkpoint)


# ------------------------------------------------------------------------------ 1-2: warm-up schedulers
def _warmup_init(self, optimizer, successor, warmup_epoch, last_epoch=-1, verbose=False) -> None:
    self.successor = successor
    self.warmup_epoch = warmup_epoch
    LRScheduler.__init__(self, optimizer, last_epoch)  # torch >= 2.7 takes no `verbose`


def _warmup_state_dict(self) -> dict:
    state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "successor")}
    state["successor"] = self.successor.state_dict()  # plain values: weights_only loading accepts it
    return state


def _warmup_load_state_dict(self, state_dict: dict) -> None:
    state = dict(state_dict)
    successor = state.pop("successor", None)
    if isinstance(successor, LRScheduler):  # a checkpoint written without this module
        successor = successor.state_dict()
    if successor is not None:
        self.successor.load_state_dict(successor)
    self.__dict__.update(state)


# ------------------------------------------------------------------------------ 2: loading checkpoints
def load_checkpoint(fpath: str) -> Any:
    """Dassl's ``load_checkpoint`` with a one-line error for checkpoints that hold pickled objects."""
    try:
        return _ORIGINAL_LOAD_CHECKPOINT(fpath)
    except pickle.UnpicklingError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise RuntimeError(
            f"{fpath}: not loadable with torch's weights_only default ({first}); it was written before "
            "trainers.gram.dassl_compat was imported. Retrain, or load this trusted file once with "
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"
        ) from None


# ------------------------------------------------------------------------------ 3: MODEL.INIT_WEIGHTS
def _strip_module(key: str) -> str:
    return key[7:] if key.startswith("module.") else key


def load_pretrained_weights(model: torch.nn.Module, weight_path: str) -> None:
    """Dassl's ``load_pretrained_weights``, refusing files whose tensors do not fit (one line, no warning)."""
    ckpt = load_checkpoint(weight_path)
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else ckpt
    own = model.state_dict()
    matched, problems = 0, []
    for key, value in OrderedDict(state).items():
        key = _strip_module(key)
        if key not in own or not hasattr(value, "shape"):
            continue
        if tuple(value.shape) == tuple(own[key].shape):
            matched += 1
            continue
        problem = f"{key} is {tuple(value.shape)} in the file but {tuple(own[key].shape)} in the model"
        if key.split(".")[-1] == "ctx" and value.dim() == own[key].dim() and value.dim() >= 2:
            n_file, n_model = value.shape[-2], own[key].shape[-2]
            problem += (
                f" (the file has {n_file} context vectors, the model {n_model}: set TRAINER.COOP.N_CTX "
                f'{n_file}, or TRAINER.COCOOP.N_CTX {n_file} for CoCoOp, and CTX_INIT "")'
            )
        problems.append(problem)
    if problems:
        raise ValueError(f"MODEL.INIT_WEIGHTS {weight_path}: " + "; ".join(problems))
    if matched == 0:
        raise ValueError(
            f"MODEL.INIT_WEIGHTS {weight_path}: no tensor in the file matches a parameter of the "
            f"model (file keys {sorted(map(_strip_module, state))[:5]})"
        )
    _ORIGINAL_LOAD_PRETRAINED(model, weight_path)


load_checkpoint._gram_original = _ORIGINAL_LOAD_CHECKPOINT
load_pretrained_weights._gram_original = _ORIGINAL_LOAD_PRETRAINED


def apply() -> None:
    """Install the patches (idempotent; done on import)."""
    base = _dassl_sched._BaseWarmupScheduler
    base.__init__ = _warmup_init
    base.state_dict = _warmup_state_dict
    base.load_state_dict = _warmup_load_state_dict
    replace = {_ORIGINAL_LOAD_PRETRAINED: load_pretrained_weights, _ORIGINAL_LOAD_CHECKPOINT: load_checkpoint}
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not names or module is sys.modules[__name__]:
            continue
        for name in ("load_pretrained_weights", "load_checkpoint"):
            fn = names.get(name)
            if fn is not None and any(fn is old for old in replace):
                setattr(module, name, replace[fn])


apply()
