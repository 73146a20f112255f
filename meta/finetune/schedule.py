"""Per-epoch learning-rate schedules with Dassl's semantics, built only from torch's scheduler classes.

The one implementation behind the Dassl trainers (``trainers/gram/dassl_schedule.py``) and the evaluator
(``meta.evaluation.make_scheduler``); errors name the Dassl ``OPTIM`` keys.

Semantics (Dassl.pytorch @ c61a1b5, ``dassl/optim/lr_scheduler.py``, default
``OPTIM.WARMUP_RECOUNT True``), for epoch ``e = 0, 1, ...``, stepped once per epoch:

* no warm-up: the main schedule at ``e``;
* ``warmup_type="constant"``: ``warmup_cons_lr`` for ``e < W``, then the main schedule restarted,
  i.e. its value at ``e - W`` (cosine: ``T_max = max_epoch``, so it never reaches its minimum);
* ``warmup_type="linear"``: ``warmup_min_lr`` at ``e = 0``, ``lr * e / W`` for ``0 < e < W``, then as above.

Main schedules: ``cosine`` (``CosineAnnealingLR(T_max=max_epoch)``), ``single_step`` (``StepLR``; ``stepsize <= 0``
means ``max_epoch``), ``multi_step`` (``MultiStepLR``) and ``constant`` (no decay; not in Dassl, used by the
evaluator).  Every state dict holds only numbers and lists, so checkpoints stay
``torch.load(weights_only=True)``-loadable (Dassl's own wrappers pickle their successor scheduler object).
"""

from __future__ import annotations

from typing import Sequence, Union

from torch.optim import Optimizer
from torch.optim import lr_scheduler as tls

SCHEDULES = ("single_step", "multi_step", "cosine", "constant")
WARMUP_TYPES = ("constant", "linear")


def _main(optimizer: Optimizer, schedule: str, max_epoch: int, stepsize, gamma: float) -> tls.LRScheduler:
    if schedule == "cosine":
        return tls.CosineAnnealingLR(optimizer, T_max=float(max_epoch))
    if schedule == "constant":
        return tls.LambdaLR(optimizer, lambda e: 1.0)
    if schedule == "single_step":
        if isinstance(stepsize, (list, tuple)):
            stepsize = stepsize[-1]
        if not isinstance(stepsize, int):
            raise TypeError(f"OPTIM.STEPSIZE: single_step needs an integer, got {stepsize!r}")
        return tls.StepLR(optimizer, step_size=stepsize if stepsize > 0 else max_epoch, gamma=gamma)
    if schedule == "multi_step":
        if not isinstance(stepsize, (list, tuple)):
            raise TypeError(f"OPTIM.STEPSIZE: multi_step needs a list of epochs, got {stepsize!r}")
        return tls.MultiStepLR(optimizer, milestones=list(stepsize), gamma=gamma)
    raise ValueError(f"OPTIM.LR_SCHEDULER: expected one of {'|'.join(SCHEDULES)}, got {schedule!r}")


def _factor(target: float, base: float) -> float:
    """Multiplier taking ``base`` to ``target`` (LambdaLR scales each group's initial lr)."""
    if base > 0:
        return target / base
    if target == 0:
        return 1.0
    raise ValueError(f"OPTIM.LR: a warm-up to {target} needs a positive learning rate, got {base}")


def epoch_scheduler(
    optimizer: Optimizer,
    schedule: str = "cosine",
    max_epoch: int = 10,
    warmup_epochs: int = 0,
    warmup_type: str = "constant",
    warmup_cons_lr: float = 1e-5,
    warmup_min_lr: float = 1e-5,
    stepsize: Union[int, Sequence[int], None] = None,
    gamma: float = 0.1,
) -> tls.LRScheduler:
    """The per-epoch schedule over ``optimizer``'s groups (their current ``lr`` is the base lr).

    Args:
        schedule: main schedule, one of :data:`SCHEDULES`.
        max_epoch: epochs of the run (cosine's ``T_max``; single_step's default step size).
        warmup_epochs: W warm-up epochs before the main schedule starts (0 = none).
        warmup_type: ``constant`` (``warmup_cons_lr``) or ``linear`` (from ``warmup_min_lr`` to lr).
        stepsize, gamma: step schedules' epochs and decay factor.
    """
    warm_type = warmup_type if warmup_epochs > 0 else "constant"
    if warm_type not in WARMUP_TYPES:
        raise ValueError(f"OPTIM.WARMUP_TYPE: expected {'|'.join(WARMUP_TYPES)}, got {warmup_type!r}")
    # Build the main schedule first: its constructor writes lr into the groups, the warm-up's then overrides.
    main = _main(optimizer, schedule, max_epoch, stepsize, gamma)
    if warmup_epochs <= 0:
        return main
    base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    if warm_type == "constant":
        factors = [_factor(float(warmup_cons_lr), b) for b in base_lrs]
        warm = tls.LambdaLR(optimizer, [lambda e, f=f: f for f in factors])
    else:
        firsts = [_factor(float(warmup_min_lr), b) for b in base_lrs]
        warm = tls.LambdaLR(optimizer, [lambda e, f=f: f if e == 0 else e / warmup_epochs for f in firsts])
    return tls.SequentialLR(optimizer, schedulers=[warm, main], milestones=[warmup_epochs])
