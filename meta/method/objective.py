"""GRAM's outer objective, written once and used by both task loops.

For one task (the sequential loop of :meth:`meta.method.gram.GRAMMetaLearner.accumulate`) or a stack of B tasks
(:mod:`meta.method.batched`, θ stacked ``[B, ...]`` and a loss summed over the tasks) the outer loss is

    L_out = L_q(θ') + w · L_q(θ)

with ``L_q(θ')`` the query loss at the adapted θ' (paper Eq. 8) and ``w · L_q(θ)`` (``query_before_weight``) asking θ
to be good before any step (it reaches θ only).  Every query loss is the task part alone
(:func:`meta.method.inner.task_loss_of`); each term is backpropagated on its own, scaled by ``1 / n_tasks``, so
``.grad`` ends as ``∇ (1/B) Σ_b L_out,b`` whichever loop ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from meta.method.inner import LossFn, task_loss_of
from meta.method.metrics import accuracy_t


@dataclass(frozen=True)
class OuterObjective:
    """The outer loss's terms (module docstring): ``query_before_weight`` w of ``L_q(θ)``, 0 = Eq. 8."""

    query_before_weight: float = 0.0

    @classmethod
    def of(cls, spec: Any) -> "OuterObjective":
        """The objective of a :class:`meta.method.gram.MetaSpec`."""
        return cls(spec.query_before_weight)

    def backward(
        self,
        meta: Any,
        loss_fn: LossFn,
        support: Any,
        query: Any,
        n_tasks: int,
        start: Optional[nn.Module] = None,
        before: Optional[Callable[[], nn.Module]] = None,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """Adapt, backpropagate every term / ``n_tasks`` into ``.grad`` and return ``(adapted clone, metrics)``.

        ``start``: the clone to adapt (default a fresh clone of θ); ``before``: the prompts ``L_q(θ)`` is taken at
        (default θ); ``backward(loss)``: how a term reaches ``.grad`` (default ``loss.backward()``).  Metrics are 0-d
        tensors ``support_loss_before`` / ``support_acc_before`` and ``query_loss_after`` / ``query_acc_after`` (a
        stack: loss sums over its tasks, accuracy means).
        """
        adapted, s_losses, s_accs = meta.unroll(loss_fn, support, start=start)
        query_fn = task_loss_of(loss_fn)  # the query measures the task alone (no regulariser)
        with meta.cast():
            q_loss, q_logits = query_fn(adapted.module, query)
        backward(q_loss.float() / n_tasks)
        w = self.query_before_weight
        if w > 0:
            with meta.cast():
                q_loss0, _ = query_fn(meta.prompt_module if before is None else before(), query)
            backward(w * q_loss0.float() / n_tasks)
        metrics = {
            "support_loss_before": s_losses[0],
            "support_acc_before": s_accs[0],
            "query_loss_after": q_loss.detach(),
            "query_acc_after": accuracy_t(q_logits.detach(), meta.labels_of(query)),
        }
        return adapted, metrics
