"""The gradient-regulating function R_φ (GRAM paper, Eqs. 5-7), as a learn2learn transform.

For a prompt gradient ``g`` ``[..., d]`` (the linear maps act on d, shared over the leading token/layer dims)::

    paper form:     γ = tanh(W_γ u + b_γ)         β = s · tanh(W_β u + b_β)     ĝ = γ ⊙ g + β
    residual form:  γ = 1 + tanh(W_γ u + b_γ)     (β as above)

with ``u`` the input of the linear maps and ``s`` the scale of the offset β.  Choices (defaults in brackets):

* ``form`` [residual]: the literal form with W = b = 0 gives γ = β = 0, an exactly zero regulated gradient, so early
  meta-steps adapt nothing; the residual form with all-zero init starts as plain MAML (ĝ = g) at any gradient scale.
  ``paper`` is the literal Eq. 5, ``gate`` is :class:`GradientGate`.
* ``input_norm`` [True]: ``u = g / rms(g)``.  Pretrained-CLIP prompt gradients can be ~1e-4, where ``W g`` is too
  small for the maps to act; normalising makes R_φ scale-free.  ``False``: the paper's ``u = g``.
* ``beta_scale`` ["grad_rms"]: the paper's absolute offset in (-1, 1) would swamp tiny gradients, so β is scaled by
  ``rms(g)`` (units of the gradient); a float gives a fixed scale (1.0 = paper).
* ``init`` ["zero"]: W = b = 0 (identity start in the residual form), or "normal": W ~ N(0, init_std²), b = 0.

Options measured and dropped: ``docs/evidence.md``, "Options removed" (an init file with one switched on is refused).

One regulator per prompt tensor (the paper's rule): deep VPT's one ``[D, n, d_v]`` tensor shares one over d_v.
learn2learn's ``GBML`` calls the transform factory (:class:`RegulatorFactory`, a plain callable, not an
``nn.Module``) once per parameter; it returns ``None`` for tensors that do not require gradients.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import nn

_EPS = 1e-12
FORMS = ("residual", "paper", "gate")


@dataclass
class RegulatorSpec:
    """Hyper-parameters of R_φ (see module docstring)."""

    form: str = "residual"  # "residual" | "paper" | "gate" (GradientGate: a gate on a regulariser's gradient)
    input_norm: bool = True
    beta_scale: Union[str, float] = "grad_rms"  # "grad_rms" or a float
    init: str = "zero"  # "zero" | "normal"
    init_std: float = 0.01
    gate_group: int = 8  # form "gate": consecutive coordinates of the last dimension that share one gate value
    context: int = 0  # width of a context s that both maps also read (meta.method.prototypes: 2); 0 = none

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"regulator form must be one of {' | '.join(FORMS)}, got {self.form!r}")
        if isinstance(self.gate_group, bool) or not isinstance(self.gate_group, int) or self.gate_group < 1:
            raise ValueError(f"regulator gate_group must be an integer >= 1, got {self.gate_group!r}")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 0:
            raise ValueError(f"regulator context must be an integer >= 0, got {self.context!r}")
        if self.context and self.form == "gate":
            raise ValueError("regulator context: the gate form takes no context")
        if self.init not in ("zero", "normal"):
            raise ValueError(f"regulator init must be 'zero' or 'normal', got {self.init!r}")
        if isinstance(self.beta_scale, str):
            if self.beta_scale != "grad_rms":
                try:
                    self.beta_scale = float(self.beta_scale)
                except ValueError:
                    raise ValueError(f"beta_scale must be 'grad_rms' or a number, got {self.beta_scale!r}") from None

    def as_dict(self) -> dict:
        """The fields; ``gate_group`` only for the gate form and ``context`` only when set, so files and records
        without them are written exactly as before those options existed."""
        d = asdict(self)
        if self.form != "gate":
            d.pop("gate_group")
        if not self.context:
            d.pop("context")
        return d


class GradientRegulator(nn.Module):
    """R_φ for one prompt tensor of last dimension ``dim`` (d_t or d_v): maps a gradient ``g`` ``[..., dim]`` to
    ĝ = γ ⊙ g + β of the same shape, as ``spec`` says (module docstring). Parameters: ``gamma`` and ``beta``, each
    ``nn.Linear(dim, dim)`` (W ``[dim, dim]``, b ``[dim]``).  With ``spec.context`` P > 0 also ``gamma_context``
    and ``beta_context`` (``[dim, P]``, no bias, zero at the start): the maps read ``W u + b + U s`` for the context
    s ``[P]`` held in :attr:`context` while :func:`conditioned` is active (none: s = 0).  Example::

        reg = GradientRegulator(512)              # residual form, zero init: the identity
        g = torch.randn(4, 512)
        torch.equal(reg(g), g)                    # True until φ is meta-trained
        g_hat, beta_part = reg.parts(g)           # ĝ and the share of it that comes from β
    """

    #: leading dimensions of a gradient that index tasks (:mod:`meta.method.batched` sets 1 on its clones): rms(g)
    #: then acts per task, so R_φ of a stacked gradient equals R_φ of each task's.  0 = the tensor is one task.
    task_dims: int = 0
    #: the context s ``[P]`` of the current step (:func:`conditioned`); None counts as s = 0
    context: Optional[torch.Tensor] = None

    def __init__(self, dim: int, spec: Optional[RegulatorSpec] = None):
        super().__init__()
        self.spec = spec or RegulatorSpec()
        self.dim = dim
        self.gamma = nn.Linear(dim, dim)
        self.beta = nn.Linear(dim, dim)
        for lin in (self.gamma, self.beta):
            _start(lin, self.spec)
        if self.spec.context:
            self.gamma_context = nn.Linear(self.spec.context, dim, bias=False)
            self.beta_context = nn.Linear(self.spec.context, dim, bias=False)
            for lin in (self.gamma_context, self.beta_context):
                nn.init.zeros_(lin.weight)

    def _pre(self, linear: nn.Linear, u: torch.Tensor, name: str) -> torch.Tensor:
        """``W u + b`` of one map, plus ``U s`` of its context map when a context is set."""
        out = linear(u)
        if self.spec.context and self.context is not None:
            s = self.context.to(device=u.device, dtype=u.dtype)
            term = getattr(self, name)(s)  # [dim], or [B, dim] for a task-stacked clone (one context per task)
            if term.dim() > 1:
                term = term.view(term.shape[0], *([1] * (u.dim() - 2)), term.shape[-1])
            out = out + term
        return out

    def modulation(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(γ, β)``, each shaped like ``grad``."""
        rms = _rms(grad, self.task_dims)
        u = grad / rms if self.spec.input_norm else grad
        gamma = torch.tanh(self._pre(self.gamma, u, "gamma_context"))
        if self.spec.form == "residual":
            gamma = 1.0 + gamma
        scale = rms if self.spec.beta_scale == "grad_rms" else float(self.spec.beta_scale)
        beta = scale * torch.tanh(self._pre(self.beta, u, "beta_context"))
        return gamma, beta

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.shape[-1] != self.dim:
            raise ValueError(f"regulator built for last dim {self.dim}, got gradient {tuple(grad.shape)}")
        return self.parts(grad)[0]

    def parts(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ĝ, β)``: the regulated gradient γ ⊙ g + β and the part of it that comes from β (shapes of ``grad``)."""
        gamma, beta = self.modulation(grad)
        return gamma * grad + beta, beta


def _rms(g: torch.Tensor, task_dims: int) -> torch.Tensor:
    """``sqrt(mean(g²) + eps)`` over all but the first ``task_dims`` dims of ``g`` (kept as size 1; 0-d when 0)."""
    sq = g.pow(2)
    mean = sq.mean() if task_dims == 0 else sq.mean(dim=tuple(range(task_dims, sq.dim())), keepdim=True)
    return mean.add(_EPS).sqrt()


@torch.no_grad()
def _start(linear: nn.Linear, spec: RegulatorSpec) -> None:
    """``spec.init``'s start of one map: weight 0 (``zero``) or N(0, init_std²) (``normal``), bias (if any) 0."""
    if linear.bias is not None:
        linear.bias.zero_()
    if spec.init == "zero":
        linear.weight.zero_()
    else:
        linear.weight.normal_(0.0, spec.init_std)


class RegulatorFactory:
    """learn2learn transform factory: ``factory(param) -> GradientRegulator | None``.

    Returns ``None`` (raw gradient) for parameters that do not require grad, or for every parameter when ``enabled`` is
    False (the "w/o gradient regulating" ablation).
    """

    def __init__(self, spec: Optional[RegulatorSpec] = None, enabled: bool = True):
        self.spec = spec or RegulatorSpec()
        self.enabled = enabled

    def __call__(self, param: torch.Tensor) -> Optional[nn.Module]:
        if not self.enabled or not param.requires_grad:
            return None
        return regulator_for(int(param.shape[-1]), self.spec).to(device=param.device, dtype=param.dtype)


def regulator_for(dim: int, spec: RegulatorSpec) -> nn.Module:
    """R_φ of one prompt tensor of last dimension ``dim``: a :class:`GradientGate` for ``form="gate"``, else a
    :class:`GradientRegulator`."""
    return GradientGate(dim, spec) if spec.form == "gate" else GradientRegulator(dim, spec)


class GradientGate(nn.Module):
    """R_φ as a learned gate on a regulariser's gradient (``RegulatorSpec.form = "gate"``). The loss is split into a
    task part and a regulariser (the zero-shot consistency terms, :mod:`meta.method.consistency`), with gradients
    ``g_task`` and ``g_reg`` of one prompt tensor (``[..., dim]``; ``spec.gate_group`` G must divide ``dim``); the
    task gradient is kept as it is and the regulariser's is scaled per coordinate group by a learned gate::

        u_task = g_task / rms(g_task),   u_reg = g_reg / rms(g_reg)          (scale-free inputs, per task)
        a      = 2 · sigmoid(W [u_task ; u_reg])                            W: [dim / G, 2 · dim], no bias
        ĝ      = g_task + repeat(a, G) ⊙ g_reg                              each a shared by G consecutive coords

    After ProMetaR (Park et al., CVPR 2024; mlvlab/ProMetaR ``trainers/prometar.py``), whose learned map never changes
    the cross-entropy gradient, only the regulariser's; here one bias-free map of rms-normalised gradients, and
    ``2 · sigmoid`` so that the zero start a = 1 is the fixed-λ regularised loss's gradient.  Parameters:
    ``gate.weight`` ``[dim // G, 2 · dim]``.  Without ``g_reg`` ĝ is ``g_task``.
    """

    #: leading dimensions that index tasks (as :attr:`GradientRegulator.task_dims`)
    task_dims: int = 0

    def __init__(self, dim: int, spec: Optional[RegulatorSpec] = None):
        super().__init__()
        self.spec = spec or RegulatorSpec(form="gate")
        group = int(self.spec.gate_group)
        if dim % group:
            raise ValueError(
                f"regulator gate_group {group} does not divide the prompt tensor's last dimension {dim} "
                f"(META.REGULATOR.GATE_GROUP)"
            )
        self.dim, self.group = dim, group
        self.gate = nn.Linear(2 * dim, dim // group, bias=False)
        _start(self.gate, self.spec)

    def gate_value(self, g_task: torch.Tensor, g_reg: torch.Tensor) -> torch.Tensor:
        """The gate ``repeat(a, G)`` in (0, 2), shaped like the gradients."""
        u_task, u_reg = g_task / _rms(g_task, self.task_dims), g_reg / _rms(g_reg, self.task_dims)
        a = 2.0 * torch.sigmoid(self.gate(torch.cat([u_task, u_reg], dim=-1)))
        return a.repeat_interleave(self.group, dim=-1)

    def forward(self, g_task: torch.Tensor, g_reg: Optional[torch.Tensor] = None) -> torch.Tensor:
        if g_task.shape[-1] != self.dim:
            raise ValueError(f"gate built for last dim {self.dim}, got gradient {tuple(g_task.shape)}")
        return g_task if g_reg is None else g_task + self.gate_value(g_task, g_reg) * g_reg


def is_gated(regulators) -> bool:
    """Whether any of ``regulators`` (modules, or None) is a :class:`GradientGate` (it needs the loss in parts)."""
    return any(isinstance(r, GradientGate) for r in regulators)


def regulate(reg: Optional[nn.Module], g_task: torch.Tensor, g_reg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ĝ of one prompt tensor: ``g_task + g_reg`` without R_φ (``reg`` None), R_φ(g_task, g_reg) for a
    :class:`GradientGate`, R_φ(g_task) for the γ/β forms; ``g_reg`` None counts as no regulariser."""
    if reg is None:
        return g_task if g_reg is None else g_task + g_reg
    return reg(g_task, g_reg) if isinstance(reg, GradientGate) else reg(g_task)


@contextlib.contextmanager
def conditioned(regulators: Iterable[Optional[nn.Module]], context: Optional[torch.Tensor]) -> Iterator[None]:
    """Hold ``context`` (``[P]``, or ``[B, P]`` for task-stacked clones; no gradient) on every regulator of
    ``regulators`` that takes one (``spec.context`` > 0) for the ``with`` block, then clear it; a learn2learn clone
    made inside the block copies it."""
    takers = [r for r in regulators if isinstance(r, GradientRegulator) and r.spec.context]
    for r in takers:
        r.context = None if context is None else context.detach()
    try:
        yield
    finally:
        for r in takers:
            r.context = None
