"""Test-time use of R_φ: regulate prompt gradients before every optimiser step (paper Eq. 7).

Usage inside any training loop (a Dassl trainer, the standalone evaluator)::

    loss.backward()
    regulation.apply_(prompt_module.named_parameters())   # p.grad <- R_φ(p.grad)
    optimizer.step()
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from .regulator import GradientRegulator


class GradientRegulation(nn.Module):
    """Frozen regulators keyed by prompt-parameter name (``"ctx"``, ``"vpt"``).

    Parameters without a regulator keep their raw gradient.  The regulators are
    frozen (φ is meta-learned, not fine-tuned) and put in eval mode.

    The regulators are copied, never modified.  ``norm_preserve`` overrides their own
    ``spec.norm_preserve`` at test time (``None`` = as meta-trained).  Every call of
    :meth:`apply_` adds, per tensor, cos(ĝ, g) and ‖ĝ‖/‖g‖ to :attr:`stats` (diagnostics).
    """

    def __init__(self, regulators: Mapping[str, GradientRegulator], norm_preserve: Optional[bool] = None):
        super().__init__()
        regulators = {k: copy.deepcopy(v) for k, v in regulators.items()}  # the caller's φ stays trainable
        if norm_preserve is not None:
            for reg in regulators.values():
                reg.spec = replace(reg.spec, norm_preserve=bool(norm_preserve))
        self.regulators = nn.ModuleDict(regulators)
        for p in self.regulators.parameters():
            p.requires_grad_(False)
        self.eval()
        self.stats: dict[str, float] = {"tensors": 0.0, "cos_sum": 0.0, "norm_ratio_sum": 0.0}

    def summary(self) -> dict[str, float]:
        """Mean cos(ĝ, g) and ‖ĝ‖/‖g‖ over every regulated tensor so far (``{}`` before the first)."""
        n = self.stats["tensors"]
        if n == 0:
            return {}
        return {"reg_cos": self.stats["cos_sum"] / n, "reg_norm_ratio": self.stats["norm_ratio_sum"] / n}

    def __len__(self) -> int:
        return len(self.regulators)

    @torch.no_grad()
    def apply_(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace ``p.grad`` by ``R_φ(p.grad)`` in place; returns how many tensors were regulated."""
        done = 0
        for name, param in named_parameters:
            key = name.split(".")[-1]  # "prompt_learner.prompts.ctx" -> "ctx"
            if param.grad is None or key not in self.regulators:
                continue
            raw = param.grad.detach().clone()
            param.grad.copy_(self.regulators[key](param.grad))
            raw_norm = raw.norm()
            self.stats["tensors"] += 1
            self.stats["cos_sum"] += float(torch.nn.functional.cosine_similarity(
                param.grad.flatten(), raw.flatten(), dim=0))
            self.stats["norm_ratio_sum"] += float(param.grad.norm() / raw_norm.clamp_min(1e-30))
            done += 1
        return done


def finetune_and_score(prompts: nn.Module, regulation: Optional[GradientRegulation], loss_fn, support, query,
                       steps: int, lr: float, momentum: float, labels_of=lambda b: b["label"]) -> float:
    """Query accuracy (0-1) after ``steps`` full-batch SGD steps on ``support`` from a copy of ``prompts``.

    Mirrors test-time use: torch SGD with ``lr`` and ``momentum`` on the prompt gradient, regulated by
    ``regulation`` when given (raw otherwise).  ``loss_fn(prompts, batch) -> (loss, logits [n, K])``.
    ``prompts`` is never modified.
    """
    theta = copy.deepcopy(prompts)
    params = [p for p in theta.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    for _ in range(steps):
        loss, _ = loss_fn(theta, support)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if regulation is not None:
            regulation.apply_(theta.named_parameters())
        optimizer.step()
    with torch.no_grad():
        _, logits = loss_fn(theta, query)
    return float((logits.argmax(dim=-1) == labels_of(query)).float().mean())
