"""The gradient-regulating function R_φ (GRAM paper, Eqs. 5-7), as a learn2learn transform.

For a prompt gradient ``g`` of shape ``[..., d]`` (the linear maps act on the
feature dimension d, shared over the leading token/layer dimensions)::

    paper form:     γ = tanh(W_γ u + b_γ)         β = s · tanh(W_β u + b_β)     ĝ = γ ⊙ g + β
    residual form:  γ = 1 + tanh(W_γ u + b_γ)     (β as above)

where ``u`` is the input fed to the linear maps and ``s`` the scale of the
offset β.  R_φ is a small core (γ and β; :meth:`GradientRegulator.core`) followed by the wrappers
the spec switches on (:data:`WRAPPERS`: norm preserving, mix, step size, in that order; each a
:class:`RegulatorWrapper`).  Design choices (all switchable; defaults in brackets); ``form``,
``input_norm``, ``beta_scale``, ``init``, ``gamma_bound`` and ``halves`` shape the core:

* ``form`` [residual].  With the paper's literal form and W = b = 0, γ = β = 0
  and the regulated gradient is exactly zero, so early meta-steps adapt
  nothing; the residual form with all-zero init starts as plain MAML (ĝ = g) at
  any gradient scale.  ``form="paper"`` gives the literal Eq. 5.
* ``input_norm`` [True]: ``u = g / rms(g)``.  Pretrained-CLIP prompt gradients can be
  ~1e-4, where ``W g`` is too small for the maps to act; normalising the input
  makes R_φ scale-free.  ``False`` gives the paper's ``u = g``.
* ``beta_scale`` ["grad_rms"]: β is an absolute offset in (-1, 1) in the paper,
  which would swamp tiny gradients; by default it is scaled by ``rms(g)`` so it is
  measured in units of the gradient.  A float gives a fixed scale (1.0 = paper).
* ``init`` ["zero"]: W = b = 0 (identity start in the residual form), or
  "normal": W ~ N(0, init_std²), b = 0.
* ``gamma_bound`` [1.0]: residual form only, γ = 1 + gamma_bound · tanh(·), so each
  coordinate's gain stays in (1 - bound, 1 + bound); a small bound keeps R_φ near
  the identity.
* ``norm_preserve`` [False] (wrapper): rescale ĝ to the Frobenius norm of the raw gradient of
  the whole prompt tensor, ĝ ← ĝ · ‖g‖ / ‖ĝ‖, so R_φ changes only the direction and
  an optimiser's lr keeps its meaning over many steps.
* ``mix`` [False] (wrapper): a learned scalar c = sigmoid(m) (m starts at ``mix_init``) mixes
  the regulated and the raw gradient, ĝ ← (1 - c) · ĝ + c · g, applied after
  ``norm_preserve``.  Facts behind both options: the same authors' regulator for
  language-model prompts (beepkh/SUPMER, ``model/grad_trans.py``) rescales its
  transformed gradient to the raw gradient's norm and then mixes it with the raw
  gradient by a learned coefficient in (0, 1) (there input-dependent; here one
  scalar per prompt tensor).
* ``halves`` ["both"]: "gamma" keeps only the gain (β ≡ 0, ĝ = γ ⊙ g), "beta" only the offset (γ ≡ 1,
  ĝ = g + β); the unused linear map stays in the state (and the file) at its initial value.
* ``learn_lr`` [False] (wrapper): a learned per-tensor step size exp(ℓ) (ℓ starts at 0) multiplies ĝ, applied last;
  Meta-SGD (Li, Zhou, Chen and Li, arXiv 1707.09835) learns step sizes beside the initialisation; here one
  per prompt tensor.  It lives in R_φ, so the init file carries it and the test-time
  regulation (``meta.finetune.regulated.GradientRegulation``) applies it with the rest of R_φ.

Deep VPT keeps one ``[D, n, d_v]`` tensor, so one regulator (over d_v) serves all
its layers: the per-tensor rule of the paper ("one regulator per prompt tensor").

learn2learn's ``GBML`` calls the transform factory once per parameter of the
wrapped module at construction; :class:`RegulatorFactory` is a plain callable
(not an ``nn.Module``) and returns ``None`` for tensors that do not require
gradients, so no regulator is ever built for frozen weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch
from torch import nn

_EPS = 1e-12
_TINY = 1e-30  # guards the norm-preserving rescale against a zero regulated gradient
HALVES = ("both", "gamma", "beta")
FORMS = ("residual", "paper", "gate")


@dataclass
class RegulatorSpec:
    """Hyper-parameters of R_φ (see module docstring)."""

    form: str = "residual"  # "residual" | "paper" | "gate" (GradientGate: a gate on a regulariser's gradient)
    input_norm: bool = True
    beta_scale: Union[str, float] = "grad_rms"  # "grad_rms" or a float
    init: str = "zero"  # "zero" | "normal"
    init_std: float = 0.01
    gamma_bound: float = 1.0  # residual form: γ ∈ (1 - bound, 1 + bound)
    norm_preserve: bool = False  # ĝ rescaled to ‖g‖ (per prompt tensor)
    mix: bool = False  # learned raw/regulated mixing coefficient c = sigmoid(m)
    mix_init: float = 0.0  # initial m (0 -> c = 0.5)
    halves: str = "both"  # both | gamma (β ≡ 0: ĝ = γ ⊙ g) | beta (γ ≡ 1: ĝ = g + β)
    learn_lr: bool = False  # Meta-SGD: a learned per-tensor step size exp(ℓ) multiplies ĝ
    gate_group: int = 8  # form "gate": consecutive coordinates of the last dimension that share one gate value

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"regulator form must be one of {' | '.join(FORMS)}, got {self.form!r}")
        if isinstance(self.gate_group, bool) or not isinstance(self.gate_group, int) or self.gate_group < 1:
            raise ValueError(f"regulator gate_group must be an integer >= 1, got {self.gate_group!r}")
        if self.form == "gate":
            core_only = [
                name
                for name, off in (("norm_preserve", False), ("mix", False), ("learn_lr", False), ("halves", "both"))
                if getattr(self, name) != off
            ]
            if core_only:
                raise ValueError(
                    f"regulator form 'gate' keeps the task gradient as it is and takes none of the γ/β options: "
                    f"set {', '.join(core_only)} to their defaults"
                )
        if self.init not in ("zero", "normal"):
            raise ValueError(f"regulator init must be 'zero' or 'normal', got {self.init!r}")
        if self.halves not in HALVES:
            raise ValueError(f"regulator halves must be one of {' | '.join(HALVES)}, got {self.halves!r}")
        self.learn_lr = bool(self.learn_lr)
        if not 0.0 < float(self.gamma_bound) <= 1.0:
            raise ValueError(f"regulator gamma_bound must be in (0, 1], got {self.gamma_bound!r}")
        self.gamma_bound = float(self.gamma_bound)
        self.norm_preserve = bool(self.norm_preserve)
        self.mix = bool(self.mix)
        self.mix_init = float(self.mix_init)
        if isinstance(self.beta_scale, str):
            if self.beta_scale != "grad_rms":
                try:
                    self.beta_scale = float(self.beta_scale)
                except ValueError:
                    raise ValueError(f"beta_scale must be 'grad_rms' or a number, got {self.beta_scale!r}") from None

    def as_dict(self) -> dict:
        """The fields; ``gate_group`` only for the gate form, so files and records of the other forms are written
        exactly as before the gate existed."""
        d = asdict(self)
        if self.form != "gate":
            d.pop("gate_group")
        return d


class GradientRegulator(nn.Module):
    """
    **Description**

    R_φ for one prompt tensor (paper Eqs. 5-7): maps a gradient ``g`` ``[..., dim]`` to ĝ of the same shape.
    It is a small **core**, ĝ = γ ⊙ g + β with γ = tanh(W_γ u + b_γ) (plus 1 in the residual form) and
    β = s · tanh(W_β u + b_β), the linear maps acting on the last dimension (``u``, ``s``: module docstring),
    followed by the **wrappers** the spec switches on, in the order of :data:`WRAPPERS` (norm preserving, mix,
    step size: :class:`RegulatorWrapper`). Parameters: the core's ``gamma`` and ``beta`` (each
    ``nn.Linear(dim, dim)``: W ``[dim, dim]``, b ``[dim]``) and each active wrapper's own, registered on this
    module under flat names (the 0-d ``mix_logit`` with ``spec.mix``, the 0-d ``log_lr`` with
    ``spec.learn_lr``; absent otherwise, so older files load).

    **Arguments**

    * **dim** (int) - the prompt tensor's last dimension (d_t or d_v).
    * **spec** (RegulatorSpec, *optional*) - form, input normalisation, β scale, init, halves, wrappers.

    **Example**

    ~~~python
    reg = GradientRegulator(512)              # residual form, zero init: the identity
    g = torch.randn(4, 512)
    torch.equal(reg(g), g)                    # True until φ is meta-trained
    g_hat, beta_part = reg.parts(g)           # ĝ and the share of it that comes from β
    ~~~
    """

    #: leading dimensions of a gradient that index tasks (a task-stacked ``[B, ...]`` gradient:
    #: :mod:`meta.method.batched` sets 1 on its clones); rms(g) and the norm-preserving rescale then act per task,
    #: so R_φ of a stacked gradient equals R_φ of each task's gradient.  0 = the whole tensor is one task.
    task_dims: int = 0

    def __init__(self, dim: int, spec: Optional[RegulatorSpec] = None):
        super().__init__()
        self.spec = spec or RegulatorSpec()
        self.dim = dim
        self.gamma = nn.Linear(dim, dim)
        self.beta = nn.Linear(dim, dim)
        with torch.no_grad():
            for lin in (self.gamma, self.beta):
                lin.bias.zero_()
                if self.spec.init == "zero":
                    lin.weight.zero_()
                else:
                    lin.weight.normal_(0.0, self.spec.init_std)
        for wrapper in self.wrappers():
            wrapper.install(self)

    def wrappers(self) -> list["RegulatorWrapper"]:
        """The wrappers ``spec`` switches on, in the order they apply (read from the spec at each call, so a
        test-time override of a parameter-free wrapper such as ``norm_preserve`` takes effect)."""
        return [w for w in WRAPPERS if w.active(self.spec)]

    def step_size(self) -> Optional[torch.Tensor]:
        """The learned per-tensor step size exp(ℓ) (0-d), or ``None`` without ``spec.learn_lr``."""
        return torch.exp(self.log_lr) if self.spec.learn_lr else None

    def mix_coefficient(self) -> Optional[torch.Tensor]:
        """c = sigmoid(m), the raw gradient's share (0-d), or ``None`` without ``spec.mix``."""
        return torch.sigmoid(self.mix_logit) if self.spec.mix else None

    def modulation(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(γ, β)``, each shaped like ``grad``."""
        rms = _task_mean(grad.pow(2), self.task_dims).add(_EPS).sqrt()
        u = grad / rms if self.spec.input_norm else grad
        gamma = torch.tanh(self.gamma(u))
        if self.spec.form == "residual":
            gamma = 1.0 + self.spec.gamma_bound * gamma
        scale = rms if self.spec.beta_scale == "grad_rms" else float(self.spec.beta_scale)
        beta = scale * torch.tanh(self.beta(u))
        return gamma, beta

    def core(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The γ/β core: ``(γ ⊙ g + β, β)`` for the halves the spec keeps (γ ≡ 1 or β ≡ 0 for the other)."""
        halves = self.spec.halves
        if halves == "both":
            gamma, beta = self.modulation(grad)
        elif halves == "gamma":
            gamma, beta = self.modulation(grad)[0], torch.zeros_like(grad)
        else:
            gamma, beta = torch.ones_like(grad), self.modulation(grad)[1]
        return gamma * grad + beta, beta

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.shape[-1] != self.dim:
            raise ValueError(f"regulator built for last dim {self.dim}, got gradient {tuple(grad.shape)}")
        return self.parts(grad)[0]

    def parts(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ĝ, b)``: the regulated gradient and the part of it that comes from β (shapes of ``grad``).

        The core gives ``(γ ⊙ g + β, β)``; each wrapper maps the pair on. Every wrapper is linear in the pair
        given its scalar factors (norm rescale, mix, step size), so ĝ − b is the part from γ ⊙ g (and, with
        ``mix``, the raw gradient's share).
        """
        out, b = self.core(grad)
        for wrapper in self.wrappers():
            out, b = wrapper.apply(self, grad, out, b)
        return out, b


class RegulatorWrapper:
    """One composable piece of R_φ applied after the core (learn2learn's transforms compose the same way).

    A wrapper is switched on by the boolean :class:`RegulatorSpec` field ``field``, registers its parameters
    (if any) on the regulator under flat names (init files keep one key per parameter) and maps the core's pair
    ``(ĝ, b)`` on: ``apply(reg, g, ĝ, b) -> (ĝ', b')``, all shaped like ``g``, ``b'`` the share of ``ĝ'`` that
    comes from β. Adding a piece is one subclass, one row of :data:`WRAPPERS` and one spec field (+ its key).
    """

    field: str = ""

    def active(self, spec: RegulatorSpec) -> bool:
        return bool(getattr(spec, self.field))

    def install(self, reg: GradientRegulator) -> None:
        """Register this wrapper's parameters on ``reg`` (none by default)."""

    def apply(
        self, reg: GradientRegulator, grad: torch.Tensor, out: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class NormPreserve(RegulatorWrapper):
    """ĝ ← ĝ · ‖g‖ / ‖ĝ‖ per task (Frobenius norms over the prompt tensor): R_φ changes only the direction."""

    field = "norm_preserve"

    def apply(self, reg, grad, out, b):
        factor = _task_norm(grad, reg.task_dims) / _task_norm(out, reg.task_dims).clamp_min(_TINY)
        return out * factor, b * factor


class Mix(RegulatorWrapper):
    """ĝ ← (1 − c) · ĝ + c · g with a learned c = sigmoid(m), m (``mix_logit``, 0-d) starting at ``mix_init``."""

    field = "mix"

    def install(self, reg):
        reg.mix_logit = nn.Parameter(torch.tensor(reg.spec.mix_init))

    def apply(self, reg, grad, out, b):
        c = reg.mix_coefficient()
        return (1.0 - c) * out + c * grad, (1.0 - c) * b


class StepSize(RegulatorWrapper):
    """ĝ ← exp(ℓ) · ĝ with a learned per-tensor step size (``log_lr``, 0-d, starts at 0): Meta-SGD's idea."""

    field = "learn_lr"

    def install(self, reg):
        reg.log_lr = nn.Parameter(torch.tensor(0.0))

    def apply(self, reg, grad, out, b):
        lr = reg.step_size()
        return lr * out, lr * b


#: the wrappers, in the order they apply after the core (one instance each; stateless: parameters live on the
#: regulator they were installed on)
WRAPPERS: tuple[RegulatorWrapper, ...] = (NormPreserve(), Mix(), StepSize())


def _task_mean(x: torch.Tensor, task_dims: int) -> torch.Tensor:
    """Mean of ``x`` over all but its first ``task_dims`` dimensions (kept as size 1; 0-d when 0)."""
    return x.mean() if task_dims == 0 else x.mean(dim=tuple(range(task_dims, x.dim())), keepdim=True)


def _task_norm(x: torch.Tensor, task_dims: int) -> torch.Tensor:
    """Frobenius norm of ``x`` per task (over all but its first ``task_dims`` dimensions, kept as size 1)."""
    return x.norm() if task_dims == 0 else x.pow(2).sum(dim=tuple(range(task_dims, x.dim())), keepdim=True).sqrt()


class RegulatorFactory:
    """learn2learn transform factory: ``factory(param) -> GradientRegulator | None``.

    Returns ``None`` (raw gradient) for parameters that do not require grad, or
    for every parameter when ``enabled`` is False (the "w/o gradient regulating"
    ablation).
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
    """
    **Description**

    R_φ as a learned gate on a regulariser's gradient (``RegulatorSpec.form = "gate"``). The loss is split into a
    task part and a regulariser (the zero-shot consistency terms, :mod:`meta.method.consistency`), with gradients
    ``g_task`` and ``g_reg`` of one prompt tensor (``[..., dim]``); the task gradient is kept as it is and the
    regulariser's is scaled per coordinate group by a learned gate::

        u_task = g_task / rms(g_task),   u_reg = g_reg / rms(g_reg)          (scale-free inputs, per task)
        a      = 2 · sigmoid(W [u_task ; u_reg])                            W: [dim / G, 2 · dim], no bias
        ĝ      = g_task + repeat(a, G) ⊙ g_reg                              each a shared by G consecutive coords

    The design follows a fact of ProMetaR (Park et al., CVPR 2024; mlvlab/ProMetaR ``trainers/prometar.py``):
    its learned map of the concatenated gradients never changes the cross-entropy gradient and gates only the
    regulariser's. Choices made here: one bias-free linear map (not two), the gradients normalised by their
    rms first (as the γ/β core does, so the gate does not depend on the gradient scale), ``G`` coordinates of the
    last dimension share a gate value (``gate_group``, 8 by default), and the gate is ``2 · sigmoid`` so that the
    zero start (``init="zero"``) is a = 1 everywhere: ĝ = g_task + g_reg, the gradient of the fixed-λ
    regularised loss. Meta-training moves the gate away from that comparator only where the query loss asks.

    Parameters: ``gate.weight`` ``[dim // G, 2 · dim]``.  Without a regulariser's gradient (``g_reg`` None) ĝ is
    ``g_task``.

    **Arguments**

    * **dim** (int) - the prompt tensor's last dimension; ``spec.gate_group`` must divide it.
    * **spec** (RegulatorSpec) - ``form="gate"``, ``gate_group``, ``init`` / ``init_std``.
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
        with torch.no_grad():
            if self.spec.init == "zero":
                self.gate.weight.zero_()
            else:
                self.gate.weight.normal_(0.0, self.spec.init_std)

    def gate_value(self, g_task: torch.Tensor, g_reg: torch.Tensor) -> torch.Tensor:
        """The gate ``repeat(a, G)`` in (0, 2), shaped like the gradients."""
        u_task = g_task / _task_mean(g_task.pow(2), self.task_dims).add(_EPS).sqrt()
        u_reg = g_reg / _task_mean(g_reg.pow(2), self.task_dims).add(_EPS).sqrt()
        a = 2.0 * torch.sigmoid(self.gate(torch.cat([u_task, u_reg], dim=-1)))
        return a.repeat_interleave(self.group, dim=-1)

    def forward(self, g_task: torch.Tensor, g_reg: Optional[torch.Tensor] = None) -> torch.Tensor:
        if g_task.shape[-1] != self.dim:
            raise ValueError(f"gate built for last dim {self.dim}, got gradient {tuple(g_task.shape)}")
        if g_reg is None:
            return g_task
        return g_task + self.gate_value(g_task, g_reg) * g_reg


def is_gated(regulators) -> bool:
    """Whether any of ``regulators`` (modules, or None) is a :class:`GradientGate` (it needs the loss in parts)."""
    return any(isinstance(r, GradientGate) for r in regulators)
