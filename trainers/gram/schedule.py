"""Per-epoch LR schedules with Dassl's semantics, built only from torch's own scheduler classes.

Why not Dassl's ``build_lr_scheduler``: its warm-up wrappers pass ``verbose`` to
``LRScheduler.__init__`` (TypeError on torch >= 2.7, raised while building the model, even for
``--eval-only``), and their ``state_dict`` pickles the successor scheduler *object*, which
``torch.load(weights_only=True)`` (the torch >= 2.6 default) refuses
(KaiyangZhou/Dassl.pytorch ``dassl/optim/lr_scheduler.py`` and ``dassl/utils/torchtools.py``).

Semantics reproduced (Dassl.pytorch @ c61a1b5, ``dassl/optim/lr_scheduler.py``, with the default
``OPTIM.WARMUP_RECOUNT True``), for epoch ``e = 0, 1, ...`` (the trainer steps once per epoch, at
the last batch, as CoOp does):

* no warm-up: the main schedule at ``e``;
* ``WARMUP_TYPE constant``: ``WARMUP_CONS_LR`` for ``e < W``, then the main schedule restarted,
  i.e. its value at ``e - W`` (cosine: ``T_max = MAX_EPOCH``, so it never reaches its minimum);
* ``WARMUP_TYPE linear``: ``WARMUP_MIN_LR`` at ``e = 0``, ``LR * e / W`` for ``0 < e < W``, then as above.

Main schedules: ``cosine`` (``CosineAnnealingLR(T_max=MAX_EPOCH)``), ``single_step`` (``StepLR``;
``STEPSIZE <= 0`` means ``MAX_EPOCH``), ``multi_step`` (``MultiStepLR``).  Every state dict holds
only numbers and lists, so checkpoints stay ``weights_only``-loadable.
"""
from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from torch.optim import lr_scheduler as tls

SCHEDULERS = ("single_step", "multi_step", "cosine")


def _main_scheduler(optimizer: Optimizer, optim_cfg: Any) -> tls.LRScheduler:
    name = optim_cfg.LR_SCHEDULER
    stepsize = optim_cfg.STEPSIZE
    if name == "cosine":
        return tls.CosineAnnealingLR(optimizer, T_max=float(optim_cfg.MAX_EPOCH))
    if name == "single_step":
        if isinstance(stepsize, (list, tuple)):
            stepsize = stepsize[-1]
        if not isinstance(stepsize, int):
            raise TypeError(f"OPTIM.STEPSIZE: single_step needs an integer, got {stepsize!r}")
        return tls.StepLR(optimizer, step_size=stepsize if stepsize > 0 else optim_cfg.MAX_EPOCH,
                          gamma=optim_cfg.GAMMA)
    if name == "multi_step":
        if not isinstance(stepsize, (list, tuple)):
            raise TypeError(f"OPTIM.STEPSIZE: multi_step needs a list of epochs, got {stepsize!r}")
        return tls.MultiStepLR(optimizer, milestones=list(stepsize), gamma=optim_cfg.GAMMA)
    raise ValueError(f"OPTIM.LR_SCHEDULER: expected one of {'|'.join(SCHEDULERS)}, got {name!r}")


def _warmup_scheduler(optimizer: Optimizer, optim_cfg: Any, warmup: int) -> tls.LRScheduler:
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    if optim_cfg.WARMUP_TYPE == "constant":
        cons_lr = float(optim_cfg.WARMUP_CONS_LR)
        return tls.LambdaLR(optimizer, [lambda e, b=b: cons_lr / b for b in base_lrs])
    if optim_cfg.WARMUP_TYPE == "linear":
        min_lr = float(optim_cfg.WARMUP_MIN_LR)
        return tls.LambdaLR(optimizer, [lambda e, b=b: min_lr / b if e == 0 else e / warmup for b in base_lrs])
    raise ValueError(f"OPTIM.WARMUP_TYPE: expected constant|linear, got {optim_cfg.WARMUP_TYPE!r}")


def build_lr_scheduler(optimizer: Optimizer, optim_cfg: Any) -> tls.LRScheduler:
    """The LR schedule of ``optim_cfg`` (Dassl's ``OPTIM`` node) over ``optimizer``, stepped once per epoch.

    Every parameter group must have a positive ``lr`` (the warm-up factor is ``WARMUP_*_LR / lr``).
    """
    if any(group["lr"] <= 0 for group in optimizer.param_groups):
        raise ValueError(f"OPTIM.LR: every parameter group needs a positive learning rate, got "
                         f"{[g['lr'] for g in optimizer.param_groups]}")
    warmup = int(optim_cfg.WARMUP_EPOCH)
    if warmup > 0 and not optim_cfg.WARMUP_RECOUNT:
        raise ValueError("OPTIM.WARMUP_RECOUNT False is not supported by GRAM trainers (Dassl's own behaviour there "
                         "is an artefact of chained stepping); CoOp/CoCoOp configs use the default True")
    # Build the main schedule first: its constructor writes LR into the groups, the warm-up's then overrides.
    main = _main_scheduler(optimizer, optim_cfg)
    if warmup <= 0:
        return main
    warm = _warmup_scheduler(optimizer, optim_cfg, warmup)
    return tls.SequentialLR(optimizer, schedulers=[warm, main], milestones=[warmup])
