"""The Dassl ``OPTIM`` node -> the library's per-epoch LR schedule (``meta.finetune.schedule``).

Why not Dassl's ``build_lr_scheduler``: its warm-up wrappers pass ``verbose`` to
``LRScheduler.__init__`` (TypeError on torch >= 2.7, raised while building the model, even for
``--eval-only``), and their ``state_dict`` pickles the successor scheduler *object*, which
``torch.load(weights_only=True)`` (the torch >= 2.6 default) refuses
(KaiyangZhou/Dassl.pytorch ``dassl/optim/lr_scheduler.py`` and ``dassl/utils/torchtools.py``).
``meta.finetune.schedule`` reproduces Dassl's values (tests/test_trainers_schedule.py compares them with
Dassl's own scheduler) from torch's classes; the trainer steps it once per epoch, as CoOp does.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from torch.optim import lr_scheduler as tls

from meta.finetune.schedule import SCHEDULES, epoch_scheduler

__all__ = ["build_lr_scheduler", "SCHEDULES"]


def build_lr_scheduler(optimizer: Optimizer, optim_cfg: Any) -> tls.LRScheduler:
    """The LR schedule of ``optim_cfg`` (Dassl's ``OPTIM`` node) over ``optimizer``, stepped once per epoch."""
    warmup = int(optim_cfg.WARMUP_EPOCH)
    if warmup > 0 and not optim_cfg.WARMUP_RECOUNT:
        raise ValueError(
            "OPTIM.WARMUP_RECOUNT False is not supported by GRAM trainers (Dassl's own behaviour there "
            "is an artefact of chained stepping); CoOp/CoCoOp configs use the default True"
        )
    return epoch_scheduler(
        optimizer,
        schedule=optim_cfg.LR_SCHEDULER,
        max_epoch=int(optim_cfg.MAX_EPOCH),
        warmup_epochs=warmup,
        warmup_type=optim_cfg.WARMUP_TYPE,
        warmup_cons_lr=float(optim_cfg.WARMUP_CONS_LR),
        warmup_min_lr=float(optim_cfg.WARMUP_MIN_LR),
        stepsize=optim_cfg.STEPSIZE,
        gamma=float(optim_cfg.GAMMA),
    )
