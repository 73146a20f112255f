"""Test-time use of R_φ: regulate prompt gradients before every optimiser step (paper Eq. 7).

Usage inside any training loop (a Dassl trainer, the standalone evaluator)::

    loss.backward()
    regulation.apply_(prompt_module.named_parameters())   # p.grad <- R_φ(p.grad)
    optimizer.step()
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from .regulator import GradientRegulator


class GradientRegulation(nn.Module):
    """Frozen regulators keyed by prompt-parameter name (``"ctx"``, ``"vpt"``).

    Parameters without a regulator keep their raw gradient.  The regulators are
    frozen (φ is meta-learned, not fine-tuned) and put in eval mode.
    """

    def __init__(self, regulators: Mapping[str, GradientRegulator]):
        super().__init__()
        self.regulators = nn.ModuleDict(dict(regulators))
        for p in self.regulators.parameters():
            p.requires_grad_(False)
        self.eval()

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
            param.grad.copy_(self.regulators[key](param.grad))
            done += 1
        return done
