"""GRAM's inner loop: the regulated, differentiable update rule of one task (paper Eq. 7 and its unroll).

:func:`inner_loop` takes the steps, :class:`InnerRule` says which optimiser it unrolls and :func:`support_windows`
which data each step sees.  A caller (:meth:`meta.method.gram.GRAMMetaLearner.unroll`, for one task or a task
stack) clones θ per task, calls :func:`inner_loop` and evaluates the query loss on ``learner.module`` (θ', connected
to θ and φ); nothing here knows how many tasks an outer step holds.

With a gate (``META.REGULATOR.FORM gate``, :class:`meta.method.regulator.GradientGate`) the loss comes in two parts,
``loss_fn.parts(module, batch) -> (task, regulariser, logits)``, and u_k = R_φ(∇ task, ∇ regulariser): the task
gradient as it is plus the gated regulariser gradient (:func:`gated_updates`).

The rule, over windows ``D_0 … D_{K-1}`` (K = ``len(windows)``), the inner SGD of torch (dampening 0, no
Nesterov, ``weight_decay`` added to the regulated gradient, as ``torch.optim.SGD`` adds it to ``p.grad``
after :class:`meta.finetune.regulated.GradientRegulation` regulated it)::

    u_k = R_φ(∇_θ L(θ_k, D_k))            (raw gradient where there is no regulator)
    d_k = u_k + λ · θ_k                  λ = rule.weight_decay
    v_k = d_k  (k = 0),   μ · v_{k-1} + d_k  (k > 0)
    θ_{k+1} = θ_k − α · v_k               α = rule.lr, μ = rule.momentum

With K = 1 and λ = 0 this is exactly ``GBML.adapt`` (θ' = θ − α R_φ(g)): the same tensors, the same ops.
Second order (``first_order=False``) keeps the graph of every support gradient; first order detaches the
gradients g_k, but φ still gets its gradient through R_φ(g_k) and θ through the identity path of each step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from meta.method._l2l import l2l
from meta.method.metrics import accuracy_t
from meta.method.regulator import is_gated, regulate

# loss_fn(prompt_module, batch) -> (loss scalar, logits [n, K])
LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]

SUPPORT_MODES = ("repeat", "split")


@dataclass(frozen=True)
class InnerRule:
    """The inner optimiser being unrolled: heavy-ball SGD with weight decay (see the module docstring).

    ``lr`` α per step (units of θ per unit regulated gradient), ``momentum`` μ in [0, 1), ``weight_decay``
    λ >= 0 (L2 coefficient, added to the regulated gradient before momentum, as torch.optim.SGD does).
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"InnerRule.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"InnerRule.weight_decay must be >= 0, got {self.weight_decay}")

    def velocity(
        self,
        updates: Sequence[Optional[torch.Tensor]],
        params: Sequence[torch.Tensor],
        previous: Optional[Sequence[Optional[torch.Tensor]]],
    ) -> list[Optional[torch.Tensor]]:
        """``v_k = μ · v_{k-1} + (u_k + λ · θ_k)`` (``v_0 = u_0 + λ · θ_0``), per tensor; θ_{k+1} = θ_k − α · v_k.

        ``updates``: the regulated gradients u_k (None where a tensor has none), ``params``: θ_k in the same
        order, ``previous``: v_{k-1} or None at the first step.  The one place the rule's arithmetic lives: the
        differentiable unroll (:func:`inner_loop`) and the launch step at test time
        (:func:`meta.finetune.regulated.launch_`) both call it, so the launched step is the meta-trained one.
        """
        wd, mu = self.weight_decay, self.momentum
        if wd > 0:
            updates = [u if u is None else u + wd * p for u, p in zip(updates, params)]
        if previous is None or mu == 0:
            return list(updates)
        return [u if v is None or u is None else mu * v + u for v, u in zip(previous, updates)]


def _take(batch: dict, index: torch.Tensor) -> dict:
    """``batch`` restricted to rows ``index``: every tensor whose first dim is the batch size is indexed."""
    n = int(batch["label"].shape[0])
    return {
        key: value.index_select(0, index.to(value.device))
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n
        else value
        for key, value in batch.items()
    }


def support_windows(support: Any, steps: int, mode: str = "repeat") -> list:
    """The data of each of ``steps`` inner steps.

    * ``repeat``: every step sees the whole support set (the paper's Alg. 1; ``[support] * steps``).
    * ``split``: the support set (a dict batch with ``"label"`` [n]) is dealt into ``steps`` disjoint,
      class-balanced windows: the j-th item of each class goes to window ``j mod steps``, so each window is
      a fresh mini-set of the same classes and domains.  Every class needs at least ``steps`` items.

    Returns a list of ``steps`` batches (the same object ``steps`` times for ``repeat``).
    """
    if steps < 1:
        raise ValueError(f"inner steps must be >= 1, got {steps}")
    if mode not in SUPPORT_MODES:
        raise ValueError(f"META.INNER_SUPPORT: expected {' | '.join(SUPPORT_MODES)}, got {mode!r}")
    if mode == "repeat" or steps == 1:
        return [support] * steps
    labels = support["label"].detach().cpu()
    rank = torch.empty_like(labels)
    for c in labels.unique():
        where = (labels == c).nonzero().flatten()
        if len(where) < steps:
            raise ValueError(
                f"META.INNER_SUPPORT split: class {int(c)} has {len(where)} support items, fewer than "
                f"the {steps} inner steps (raise TASKS.N_SUPPORT to steps x shots per window)"
            )
        rank[where] = torch.arange(len(where))
    return [_take(support, (rank % steps == k).nonzero().flatten()) for k in range(steps)]


def task_loss_of(loss_fn: LossFn) -> LossFn:
    """The task part of ``loss_fn`` (``loss_fn.task_loss``: the cross-entropy without a regulariser), or
    ``loss_fn`` itself: the query loss of meta-training, which measures the task alone."""
    return getattr(loss_fn, "task_loss", None) or loss_fn


def gated_updates(
    learner: "l2l.algorithms.GBML",
    task_loss: torch.Tensor,
    penalty: torch.Tensor,
    params: Sequence[torch.Tensor],
    create_graph: bool,
) -> list[Optional[torch.Tensor]]:
    """Per parameter, ĝ = R_φ(g_task, g_reg) from the two parts of the loss
    (:class:`meta.method.regulator.GradientGate`).

    ``task_loss`` and ``penalty`` are 0-d; their gradients are taken apart (``create_graph`` for second order). A
    parameter without a gate gets the plain sum g_task + g_reg; a part that does not reach a parameter counts as 0.
    """
    n = len(params)
    g_task = torch.autograd.grad(task_loss, params, create_graph=create_graph, retain_graph=True, allow_unused=True)
    if penalty.requires_grad:
        g_reg = torch.autograd.grad(
            penalty, params, create_graph=create_graph, retain_graph=create_graph, allow_unused=True
        )
    else:  # a regulariser with no path to θ (e.g. only the image term, no visual prompts)
        g_reg = (None,) * n
    update = learner.compute_update
    out: list[Optional[torch.Tensor]] = []
    for gt, gr, index in zip(g_task, g_reg, update.transforms_indices):
        if gt is None and gr is None:
            out.append(None)
            continue
        gt = torch.zeros_like(gr) if gt is None else gt
        out.append(regulate(None if index is None else update.transforms_modules[index], gt, gr))
    return out


def inner_loop(
    learner: "l2l.algorithms.GBML",
    loss_fn: LossFn,
    windows: Sequence[Any],
    rule: InnerRule,
    *,
    first_order: bool,
    labels_of: Callable[[Any], torch.Tensor] = lambda b: b["label"],
    forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Take ``len(windows)`` regulated steps of ``rule`` (one batch per step, :func:`support_windows`) on
    ``learner.module``, in place (differentiably; ``first_order`` detaches the support gradients).

    ``learner`` is a GBML *clone* holding θ_0, its ``compute_update`` R_φ; after the call ``learner.module`` holds θ_K,
    connected to θ_0 (and through it to the live θ) and to φ.  ``loss_fn(module, batch) -> (loss 0-d, logits [n, C])``;
    ``forward_context()``: the context of each support forward (autocast, attention kernel).  Returns ``(losses,
    accuracies)``: 0-d tensors, one per step, measured at θ_k before its step (no host sync).
    """
    diff_sgd = learner.diff_sgd if rule.lr == learner.lr else l2l.optim.DifferentiableSGD(lr=rule.lr)
    gated = is_gated(learner.compute_update.transforms_modules)
    parts = getattr(loss_fn, "parts", None)
    if gated and parts is None:
        raise ValueError(
            "META.REGULATOR.FORM gate regulates a regulariser's gradient, but the support loss has none: set "
            "META.CONSISTENCY.TEXT_WEIGHT or META.CONSISTENCY.IMAGE_WEIGHT > 0"
        )
    velocity: Optional[list] = None
    losses, accs = [], []
    for batch in windows:
        params = list(learner.module.parameters())
        if gated:
            with forward_context():
                task_loss, penalty, logits = parts(learner.module, batch)
            loss = task_loss + penalty
            updates = gated_updates(learner, task_loss, penalty, params, create_graph=not first_order)
        else:
            with forward_context():
                loss, logits = loss_fn(learner.module, batch)
            updates = learner.compute_update(
                loss,
                params,
                create_graph=not first_order,
                retain_graph=not first_order,
                allow_unused=learner.allow_unused,
                allow_nograd=learner.allow_nograd,
            )
        velocity = rule.velocity(list(updates), params, velocity)
        diff_sgd(learner.module, velocity)
        losses.append(loss.detach())
        accs.append(accuracy_t(logits.detach(), labels_of(batch)))
    return losses, accs
