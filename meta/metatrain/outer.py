"""The outer update of meta-training: θ at lr λ1 and φ at lr λ2 from the gradients that
:meth:`meta.method.gram.GRAMMetaLearner.accumulate` leaves in ``.grad``.

The learner clones, adapts and backpropagates; this module owns the step after: the optimiser (Adam, or SGD with
momentum 0.9; φ may carry an L2 weight decay), the fp16 ``GradScaler`` (``MetaSpec.autocast fp16`` on CUDA), the
global-norm clip over θ and φ (0 = off) and the check that skips a step whose gradient or loss is not finite.

Usage::

    learner = GRAMMetaLearner(theta, MetaSpec())
    outer = OuterStep(learner, OuterSpec(outer_lr_prompt=2e-3))
    metrics = outer.meta_step(tasks, loss_fn)      # accumulate, then clip, check and step
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Iterator, Optional, Sequence

import torch

from meta.config import GRAD_CLIP, OUTER_LR_PROMPT, OUTER_LR_REGULATOR, OUTER_OPTIMIZER, REGULATOR_WEIGHT_DECAY
from meta.method.gram import GRAMMetaLearner, LossFn, TaskBatch

log = logging.getLogger(__name__)

OUTER_OPTIMIZERS = ("adam", "sgd")


@dataclass
class OuterSpec:
    """The outer update's settings (values the paper does not give are ours).  The defaults are written once, in
    :mod:`meta.config` beside the ``META`` keys of the same names, which cannot import this module."""

    outer_lr_prompt: float = OUTER_LR_PROMPT  # λ1 (θ)
    outer_lr_regulator: float = OUTER_LR_REGULATOR  # λ2 (φ)
    optimizer: str = OUTER_OPTIMIZER  # "adam" | "sgd" (momentum 0.9)
    grad_clip: float = GRAD_CLIP  # max global norm over θ and φ; 0 = off
    regulator_weight_decay: float = REGULATOR_WEIGHT_DECAY  # L2 on φ in the outer optimiser: pulls φ to 0 = identity
    #                                                          R_φ (residual form)

    def __post_init__(self) -> None:
        if self.optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"OuterSpec.optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.regulator_weight_decay < 0:
            raise ValueError(f"OuterSpec.regulator_weight_decay must be >= 0, got {self.regulator_weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"OuterSpec.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")

    def as_dict(self) -> dict:
        return asdict(self)


class OuterStep:
    """The outer optimiser of one :class:`~meta.method.gram.GRAMMetaLearner` (parameter groups ``prompt`` and,
    when R_φ has parameters, ``regulator``; settings ``spec``, default :class:`OuterSpec`), its fp16 loss scaler
    (when the learner's ``MetaSpec.autocast`` is ``fp16``) and the count of skipped steps."""

    def __init__(self, learner: GRAMMetaLearner, spec: Optional[OuterSpec] = None):
        spec = spec or OuterSpec()
        self.spec = spec
        self.learner = learner
        self.grad_clip = spec.grad_clip
        groups = [{"params": list(learner.prompt_module.parameters()), "lr": spec.outer_lr_prompt, "name": "prompt"}]
        reg_params = list(learner.gbml.compute_update.parameters())
        if reg_params:
            lr, decay = spec.outer_lr_regulator, spec.regulator_weight_decay
            groups.append({"params": reg_params, "lr": lr, "name": "regulator", "weight_decay": decay})
        self.optimizer = torch.optim.Adam(groups) if spec.optimizer == "adam" else torch.optim.SGD(groups, momentum=0.9)
        # fp16 scales the outer loss (the inner support gradient is taken unscaled: prefer bf16)
        self.scaler = (
            torch.amp.GradScaler("cuda", enabled=torch.cuda.is_available()) if learner.spec.autocast == "fp16" else None
        )
        self.skipped_steps = 0

    def params(self) -> Iterator[torch.nn.Parameter]:
        """θ's and φ's parameters, group by group (what ``torchrun`` averages before :meth:`step`)."""
        return (p for g in self.optimizer.param_groups for p in g["params"])

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the GradScaler under fp16 (what :meth:`meta_step` hands the learner)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def meta_step(self, tasks: Sequence[TaskBatch], loss_fn: LossFn, detailed: bool = False) -> dict[str, float]:
        """One outer update from a meta-batch of ``B`` tasks: the learner's
        :meth:`~meta.method.gram.GRAMMetaLearner.accumulate`, then :meth:`step`; the metrics of both."""
        metrics = self.learner.accumulate(tasks, loss_fn, detailed=detailed, backward=self.backward)
        metrics.update(self.step(metrics["query_loss_after"]))
        return metrics

    def step(self, loss_value: float = 0.0) -> dict[str, float]:
        """Clip, check finiteness, and apply the outer update to θ (λ1) and φ (λ2).

        A non-finite gradient or loss skips the update (counted in ``skipped_steps`` and logged).  Returns
        ``grad_norm`` (before clipping, when clipping is on) and ``skipped`` (1.0 or 0.0).
        """
        params = list(self.params())
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and check the true gradient
        grads = [p.grad for p in params if p.grad is not None]
        finite = math.isfinite(loss_value) and (
            not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        )  # one sync
        out: dict[str, float] = {}
        if self.grad_clip > 0 and finite:
            out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        if finite:
            (self.scaler.step if self.scaler is not None else lambda opt: opt.step())(self.optimizer)
        else:
            self.skipped_steps += 1
            log.warning("non-finite meta-gradient or loss: outer step skipped (%d so far)", self.skipped_steps)
        if self.scaler is not None:
            self.scaler.update()  # an overflow lowers the scale for the next step
        self.optimizer.zero_grad(set_to_none=True)
        out["skipped"] = float(not finite)
        return out

    def state(self) -> dict:
        """The optimiser, the skipped-step count and (fp16) the scaler: with the learner's
        :meth:`~meta.method.gram.GRAMMetaLearner.state`, everything a resume needs."""
        out = {"optimizer": self.optimizer.state_dict(), "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
