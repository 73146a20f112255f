"""How much of θ's travel over a fine-tuning schedule comes from R_φ's offset β.

R_φ regulates ĝ = γ ⊙ g + β (:mod:`meta.method.regulator`).  Torch SGD is linear in its gradients, so the travel
θ_T − θ_0 = −Σ_t lr_t v_t splits exactly into the part the β terms drive, through their own momentum buffer
v^β_t = μ v^β_{t−1} + b_t, and the rest.  :class:`TravelSplit` measures that split for whatever fine-tuning runs
inside it: it wraps :meth:`meta.method.regulator.GradientRegulator.forward` to keep ĝ and its β part, and a global
optimiser step pre-hook pairs each ``p.grad`` (``n · ĝ`` for a window of n) with them and advances both buffers.

Steps outside a torch optimiser (the launch step, :func:`meta.finetune.regulated.launch_`) are not counted: the split
covers the schedule.  Units: travel in θ's units; ``beta_share`` = ‖travel_β‖ / ‖travel‖, ``beta_projection``
= ⟨travel_β, travel⟩ / ‖travel‖² (the fraction of the travel along its own direction that β supplies).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from meta.method.regulator import GradientRegulator

_PAIR_TOL = 1e-4  # relative residual under which p.grad counts as a multiple of a recorded ĝ


class TravelSplit:
    """Context manager recording the β part of every SGD step taken inside it (see the module docstring).

    After the block: :meth:`summary` (over all parameters) and ``per_param`` (``{id: dict}``).
    """

    def __init__(self) -> None:
        self._calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._state: dict[int, dict] = {}
        self.steps = 0
        self.unpaired = 0
        self._forward = None
        self._hook = None

    # --- recording -------------------------------------------------------------------------------
    def __enter__(self) -> "TravelSplit":
        original = GradientRegulator.forward
        calls = self._calls

        def forward(reg: GradientRegulator, grad: torch.Tensor) -> torch.Tensor:
            if grad.shape[-1] != reg.dim:
                return original(reg, grad)
            out, b = reg.parts(grad)
            calls.append((out.detach().clone(), b.detach().clone()))
            return out

        self._forward = original
        GradientRegulator.forward = forward
        self._hook = register_optimizer_step_pre_hook(self._pre_step)
        return self

    def __exit__(self, *exc) -> None:
        GradientRegulator.forward = self._forward
        if self._hook is not None:
            self._hook.remove()

    def _beta_of(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """β part of ``grad`` when it is a multiple of a recorded ĝ (that record is consumed), else None."""
        for i, (out, b) in enumerate(self._calls):
            if out.shape != grad.shape:
                continue
            denom = (out * out).sum()
            if denom <= 0:
                continue
            scale = (grad * out).sum() / denom
            if (grad - scale * out).norm() <= _PAIR_TOL * grad.norm().clamp_min(1e-30):
                del self._calls[i]
                return scale * b
        return None

    @torch.no_grad()
    def _pre_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(f"TravelSplit: measures torch.optim.SGD schedules, got {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group.get("nesterov") or group.get("dampening", 0):
                raise ValueError("TravelSplit: needs SGD without Nesterov and dampening 0")
            lr, mu, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                beta = self._beta_of(p.grad)
                if beta is None:
                    self.unpaired += 1
                    beta = torch.zeros_like(p.grad)
                full = p.grad + wd * p if wd else p.grad.clone()
                st = self._state.get(id(p))
                if st is None:
                    st = self._state[id(p)] = {
                        "v": full.clone(),
                        "vb": beta.clone(),
                        "travel": torch.zeros_like(p),
                        "travel_beta": torch.zeros_like(p),
                    }
                else:
                    st["v"] = mu * st["v"] + full if mu else full.clone()
                    st["vb"] = mu * st["vb"] + beta if mu else beta.clone()
                st["travel"] -= lr * st["v"]
                st["travel_beta"] -= lr * st["vb"]
        self._calls.clear()
        self.steps += 1

    # --- results ---------------------------------------------------------------------------------
    @property
    def per_param(self) -> dict[int, dict]:
        return self._state

    def summary(self) -> dict[str, float]:
        """``travel_norm``, ``beta_travel_norm``, ``beta_share``, ``beta_projection`` over all parameters stepped,
        and ``steps`` / ``unpaired`` (parameter-steps whose gradient was not regulated)."""
        if not self._state:
            return {"steps": float(self.steps), "unpaired": float(self.unpaired)}
        travel = torch.cat([s["travel"].flatten() for s in self._state.values()])
        beta = torch.cat([s["travel_beta"].flatten() for s in self._state.values()])
        norm2 = float(travel.pow(2).sum())
        return {
            "steps": float(self.steps),
            "unpaired": float(self.unpaired),
            "travel_norm": norm2**0.5,
            "beta_travel_norm": float(beta.norm()),
            "beta_share": float(beta.norm()) / max(norm2**0.5, 1e-30),
            "beta_projection": float((beta * travel).sum()) / max(norm2, 1e-30),
        }
