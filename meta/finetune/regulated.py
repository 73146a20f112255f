"""Test-time use of R_φ: regulate prompt gradients before every optimiser step (paper Eq. 7).

Inside any training loop (the Dassl trainers and the evaluator go through :class:`RegulatedStepper`, which adds
the window below and mixed precision): ``loss.backward()``, ``regulation.apply_(theta.named_parameters())``
(``p.grad <- R_φ(p.grad)``), ``optimizer.step()``.  Two switches match test-time use to meta-training:

* a regulation window (:class:`UpdateWindow`): meta-training applies R_φ once to the *mean* gradient of a support
  set, while CoCoOp's batch-1 schedule makes one gradient per image.  With a window of W images the raw gradients
  are summed in ``p.grad`` and once per window ``p.grad <- n · R_φ(p.grad / n)`` (n = images in the window) comes
  before one optimiser step: R_φ sees the mean gradient, the step keeps the lr budget of n per-image steps.
  W = 1 is the per-image rule.
* a launch step (:class:`LaunchStep`, :func:`launch_`): meta-training optimises the query loss *after* the inner
  step θ' = θ − α R_φ(∇L_s(θ)), so θ* is a launch point; launching applies that step once, with the mean gradient
  over the few-shot train set and the init file's α, step count and inner momentum, before the schedule starts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from meta.method.inner import InnerRule
from meta.method.metrics import accuracy
from meta.method.regulator import GradientRegulator, is_gated, regulate

# a loss: one 0-d tensor, or (task loss, regulariser) for the gate form of R_φ
LossOut = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

# Test-time defaults of the two switches (module docstring), read by MethodSpec, the Dassl trainers' TRAINER.GRAM
# keys and the demo; chosen on validation splits (docs/notes/gram_training_match.md).  A window of 0 means "the
# meta-training support size" (:func:`resolve_window`): R_φ sees the mean gradient of as many images as in training.
SUPPORT_WINDOW = 0
DEFAULT_REG_WINDOW = SUPPORT_WINDOW  # val sweep, worlds 0 + 1: every W = 20 (support) setting beat every W = 1 one
DEFAULT_LAUNCH = True  # with W = support size, launch on was best on the mean over both worlds


def support_size(metadata: Mapping, source: str = "init file") -> int:
    """Images per meta-training support set (``k_way × n_support``) from an init file's
    ``provenance.tasks`` (written by ``python -m meta train`` / ``export``)."""
    tasks = (metadata.get("provenance") or {}).get("tasks") or {}
    try:
        size = int(tasks["k_way"]) * int(tasks["n_support"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{source}: provenance.tasks.k_way / n_support are missing, so the regulation window "
            f"'support size' (0) is unknown; give the window in images (>= 1)"
        ) from None
    if size < 1:
        raise ValueError(f"{source}: provenance.tasks gives a support of {size} images; expected >= 1")
    return size


def resolve_window(window: int, metadata: Optional[Mapping], source: str = "init file") -> int:
    """The regulation window in images: ``window`` itself when >= 1, the meta-training support size of
    ``metadata`` (:func:`support_size`) when it is :data:`SUPPORT_WINDOW` (0)."""
    window = int(window)
    if window < 0:
        raise ValueError(f"regulation window must be >= 0 (0 = the meta-training support size), got {window}")
    return window if window >= 1 else support_size(metadata or {}, source)


def window_batches(images: int, batch_size: int) -> int:
    """A regulation window of ``images`` images as backward passes of ``batch_size`` images (rounded, >= 1): the one
    change of unit (``MethodSpec.reg_window``, ``META.VAL_REG_WINDOW``, ``TRAINER.GRAM.REG_WINDOW_IMAGES`` give
    images; the loops count batches)."""
    if int(images) < 1 or int(batch_size) < 1:
        raise ValueError(f"window_batches: need images >= 1 and batch_size >= 1, got {images} and {batch_size}")
    return max(1, round(int(images) / int(batch_size)))


class GradientRegulation(nn.Module):
    """Frozen copies of the meta-learned ``regulators`` (R_φ per prompt tensor name) that replace each prompt gradient
    by its regulated version before the optimiser step; :attr:`stats` sums cos(ĝ, g) and ‖ĝ‖/‖g‖.  Example::

        regulation = GradientRegulation(load_gram_init(path).regulator_modules())
        loss.backward()
        regulation.apply_(theta.named_parameters(), count=n)   # p.grad <- n * R_phi(p.grad / n)
        optimizer.step()
    """

    def __init__(self, regulators: Mapping[str, GradientRegulator], prototypes=None):
        super().__init__()
        self.prototypes = prototypes  # meta.method.prototypes.Prototypes R_φ's context is read from (test-time tuning)
        regulators = {k: copy.deepcopy(v) for k, v in regulators.items()}  # the caller's φ stays trainable
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

    @property
    def gated(self) -> bool:
        """Whether R_φ is the gate form (:class:`meta.method.regulator.GradientGate`): the loss must come in two
        parts."""
        return is_gated(self.regulators.values())

    def bind(
        self, named_parameters: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor, Optional[nn.Module]]]:
        """``[(name, parameter, R_φ or None)]``: each of θ's own ``named_parameters`` (the names an init file keys R_φ
        by) with its regulator; a regulator whose tensor θ does not hold is a ValueError (it would never act)."""
        named = list(named_parameters)
        held = {name for name, _ in named}
        lost = sorted(set(self.regulators) - held)
        if lost:
            raise ValueError(
                f"R_φ holds regulators for {', '.join(lost)}, which θ's parameters ({', '.join(sorted(held))}) do not "
                f"include: pass θ's own named_parameters()"
            )
        return [(name, param, self.regulators[name] if name in self.regulators else None) for name, param in named]

    @torch.no_grad()
    def apply_(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        count: int = 1,
        penalty_grads: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> int:
        """Replace ``p.grad`` (the sum of ``count`` passes' gradients) by ``count · R_φ(p.grad / count)`` in place;
        returns how many tensors were regulated.  The gate form: ``penalty_grads`` (``{name: gradient}``, summed
        alike) gives ``count · R_φ(g_task / count, g_reg / count)``; a tensor without a gate gets g_task + g_reg.
        """
        if count < 1:
            raise ValueError(f"GradientRegulation.apply_: count must be >= 1, got {count}")
        penalty_grads = penalty_grads or {}
        done = 0
        for name, param, reg in self.bind(named_parameters):
            g_reg = penalty_grads.get(name)
            if g_reg is not None and param.grad is None:
                param.grad = torch.zeros_like(param)
            if param.grad is None:
                continue
            if reg is None:
                if g_reg is not None:
                    param.grad.add_(g_reg)
                continue
            raw = param.grad.detach().clone()
            param.grad.copy_(regulate(reg, param.grad / count, None if g_reg is None else g_reg / count) * count)
            raw_norm = raw.norm()
            self.stats["tensors"] += 1
            self.stats["cos_sum"] += float(
                torch.nn.functional.cosine_similarity(param.grad.flatten(), raw.flatten(), dim=0)
            )
            self.stats["norm_ratio_sum"] += float(param.grad.norm() / raw_norm.clamp_min(1e-30))
            done += 1
        return done


GATE_WITHOUT_REGULARISER = (
    "R_φ is a gate on the consistency regulariser's gradient, but the fine-tuning loss has no regulariser: set its "
    "weight (TRAINER.GRAM.CONSISTENCY_TEXT / _IMAGE, or the method's consistency_text / consistency_image) as in "
    "meta-training (META.CONSISTENCY.*)"
)


def check_gate_regulariser(regulation: Optional[GradientRegulation], regularised: bool) -> None:
    """Refuse, before any work, a gate with a fine-tuning loss that has no regulariser (nothing to act on)."""
    if regulation is not None and regulation.gated and not regularised:
        raise ValueError(GATE_WITHOUT_REGULARISER)


class UpdateWindow:
    """When to regulate and step with a regulation window of ``size`` backward passes: ``window.push(last=...)``
    after each backward is 0 (keep accumulating) or the passes to regulate and step; the epoch's last batch closes a
    window (the LR changes per epoch)."""

    def __init__(self, size: int = 1):
        if int(size) < 1:
            raise ValueError(f"regulation window must be >= 1 image, got {size}")
        self.size = int(size)
        self.pending = 0

    def push(self, last: bool = False) -> int:
        """Count one backward pass; return the window's pass count when it is closed now, else 0."""
        self.pending += 1
        if self.pending >= self.size or last:
            n, self.pending = self.pending, 0
            return n
        return 0


class RegulatedStepper:
    """One regulated update per window of backward passes (paper Eq. 7 at test time, windowed): when the
    :class:`UpdateWindow` closes, the summed gradient of ``module``'s parameters becomes ``n · R_φ(mean)``,
    ``optimizer`` steps and the gradients are cleared (``regulation`` None: raw gradients).  With ``scaler`` (a
    ``torch.amp.GradScaler``) the gradients are unscaled before R_φ, which must see the true gradient.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        regulation: Optional[GradientRegulation],
        window: int = 1,
        scaler=None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.regulation = regulation
        self.window = UpdateWindow(window)
        self.scaler = scaler
        self._penalty_grads: dict[str, torch.Tensor] = {}  # the gate form: the regulariser's summed gradients

    @property
    def wants_parts(self) -> bool:
        """Whether :meth:`backward` needs the loss in two parts (task loss, ``penalty``): R_φ is a gate."""
        return self.regulation is not None and self.regulation.gated

    def backward(self, loss: torch.Tensor, last: bool = False, penalty: Optional[torch.Tensor] = None) -> int:
        """Backward ``loss`` (with a gate: the task loss, ``penalty`` the regulariser, summed apart); step when the
        window closes (``last``: the epoch's last batch); returns the passes stepped now (0 = still open)."""
        if self.wants_parts:
            self._penalty_backward(penalty)
        elif penalty is not None:
            loss = loss + penalty
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        count = self.window.push(last=last)
        if count:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.regulation is not None:
                penalty_grads, self._penalty_grads = self._penalty_grads, {}
                self.regulation.apply_(self.module.named_parameters(), count=count, penalty_grads=penalty_grads)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return count

    def _penalty_backward(self, penalty: Optional[torch.Tensor]) -> None:
        """Add the regulariser's gradient to the window's sums (graph kept for the task loss's backward)."""
        if penalty is None:
            raise ValueError(GATE_WITHOUT_REGULARISER)
        if self.scaler is not None:
            raise ValueError("R_φ as a gate does not run under an fp16 GradScaler yet: use PREC fp32 or bf16")
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        for name, grad in penalty_gradients(penalty, named).items():
            held = self._penalty_grads.get(name)
            self._penalty_grads[name] = grad if held is None else held + grad


def penalty_gradients(penalty: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: ∂penalty/∂p}`` for the parameters ``penalty`` reaches (graph kept: the task loss backwards next): the
    regulariser's gradient that the gate takes apart from the task's (differentiable twin:
    :func:`meta.method.inner.gated_updates`)."""
    if not penalty.requires_grad:
        return {}
    grads = torch.autograd.grad(penalty, [p for _, p in named], retain_graph=True, allow_unused=True)
    return {name: grad for (name, _), grad in zip(named, grads) if grad is not None}


def step_on_batch(
    stepper: RegulatedStepper, loss_fn, module: nn.Module, batch, last: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch through ``stepper``: the loss of ``loss_fn(module, batch)``, in two parts when R_φ is a
    gate (``loss_fn.parts``, :attr:`RegulatedStepper.wants_parts`).  Returns ``(loss 0-d, logits [n, K])``, the
    loss being the whole training loss (task + regulariser) either way."""
    if stepper.wants_parts and getattr(loss_fn, "parts", None) is not None:
        task, penalty, logits = loss_fn.parts(module, batch)
        stepper.backward(task, last=last, penalty=penalty)
        return (task + penalty).detach(), logits
    loss, logits = loss_fn(module, batch)
    stepper.backward(loss, last=last)
    return loss, logits


@dataclass(frozen=True)
class LaunchStep:
    """The meta-trained inner step, applied once at the start of fine-tuning (:func:`launch_`): the inner lr
    ``alpha`` α, step count, heavy-ball ``momentum`` μ and ``weight_decay`` λ (:class:`meta.method.inner.InnerRule`)
    of the :class:`meta.method.gram.MetaSpec` that meta-trained θ*.  Every launched step sees the whole train set
    (``META.INNER_SUPPORT repeat``); a file meta-trained with ``split`` over several steps is refused.
    """

    alpha: float
    steps: int = 1
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not self.alpha > 0 or self.steps < 1 or not 0.0 <= self.momentum < 1.0 or self.weight_decay < 0:
            raise ValueError(
                f"LaunchStep: need alpha > 0, steps >= 1, 0 <= momentum < 1, weight_decay >= 0; got {self}"
            )

    @property
    def rule(self) -> InnerRule:
        """The inner optimiser this step unrolls (the same object meta-training's inner loop used)."""
        return InnerRule(lr=self.alpha, momentum=self.momentum, weight_decay=self.weight_decay)

    @classmethod
    def from_metadata(cls, metadata: Mapping, source: str = "init file") -> "LaunchStep":
        """From a GRAM init file's metadata (``provenance.meta``, written by ``python -m meta train``)."""
        return cls.from_meta_record((metadata.get("provenance") or {}).get("meta") or {}, source)

    @classmethod
    def from_meta_record(cls, meta: Mapping, source: str = "init file") -> "LaunchStep":
        """From ``MetaSpec.as_dict()`` (an init file's ``provenance.meta``): the one reader of the inner rule for a
        file and a live meta-learner alike."""
        if "inner_lr" not in meta:
            raise ValueError(
                f"{source}: provenance.meta.inner_lr is missing, so the meta-trained step cannot be "
                f"launched; turn the launch step off or export the file with `python -m meta export`"
            )
        steps = int(meta.get("inner_steps", 1))
        if meta.get("inner_support", "repeat") == "split" and steps > 1:
            raise ValueError(
                f"{source}: meta-trained with provenance.meta.inner_support split ({steps} steps on disjoint support "
                f"windows), which the launch step does not reproduce; set TRAINER.GRAM.LAUNCH False (or the "
                f"method's launch off)"
            )
        return cls(
            alpha=float(meta["inner_lr"]),
            steps=steps,
            momentum=float(meta.get("inner_momentum", 0.0)),
            weight_decay=float(meta.get("inner_weight_decay", 0.0)),
        )


def launch_step_of(metadata: Mapping, source: str = "init file", explicit: bool = False) -> Optional[LaunchStep]:
    """The :class:`LaunchStep` of an init file, or None for a prompt pre-training file (no inner step), an error
    when the launch was asked for ``explicit``-ly."""
    if (metadata.get("provenance") or {}).get("mode") == "pretrain":
        if explicit:
            raise ValueError(
                f"{source}: made by prompt pre-training (provenance.mode pretrain), which has no "
                f"inner step to launch; turn the launch step off"
            )
        return None
    return LaunchStep.from_metadata(metadata, source)


def weighted_sum(terms: Iterable[tuple[LossOut, float]]) -> LossOut:
    """``Σ_b w_b · loss_b`` over ``(loss_b, w_b)`` pairs, in order (a launch set's mean loss: ``w_b`` = batch size /
    set size); a loss is 0-d or, for the gate, a ``(task loss, regulariser)`` pair summed part by part."""
    total: Optional[LossOut] = None
    for loss, w in terms:
        if isinstance(loss, tuple):
            total = tuple(x * w for x in loss) if total is None else tuple(a + x * w for a, x in zip(total, loss))
        else:
            total = loss * w if total is None else total + loss * w
    if total is None:
        raise ValueError("weighted_sum: no batches")
    return total


class RuleStep(torch.optim.Optimizer):
    """The launch step's optimiser: θ <- θ − α · v_k with v_k the meta-trained inner rule's velocity
    (:meth:`meta.method.inner.InnerRule.velocity`: regulated gradient, weight decay, heavy-ball momentum), so that
    :class:`RegulatedStepper` takes the launch step as it takes every fine-tuning step."""

    def __init__(self, params: Sequence[torch.Tensor], step: LaunchStep):
        super().__init__(list(params), {})
        self.launch = step
        self._velocity: Optional[list] = None

    @torch.no_grad()
    def step(self, closure=None) -> None:
        tensors = self.param_groups[0]["params"]
        self._velocity = self.launch.rule.velocity([p.grad for p in tensors], tensors, self._velocity)
        for p, v in zip(tensors, self._velocity):
            if v is not None:
                p.sub_(self.launch.alpha * v)


def launch_(prompts: nn.Module, regulation: Optional["GradientRegulation"], mean_loss, step: LaunchStep) -> float:
    """θ <- θ − α · v_k for ``step.steps`` steps, in place: the meta-training inner loop run once on the downstream
    data, no graph.  ``mean_loss(prompts)``: the few-shot train set's mean loss (or ``(task loss, regulariser)`` for
    the gate); ``regulation`` None = raw gradient.  Returns the loss before the first step.
    """
    params = [p for p in prompts.parameters() if p.requires_grad]
    stepper = RegulatedStepper(prompts, RuleStep(params, step), regulation)  # window 1: one step per call
    first = float("nan")
    for i in range(step.steps):
        for p in params:
            p.grad = None
        out = mean_loss(prompts)
        loss, penalty = out if isinstance(out, tuple) else (out, None)
        if i == 0:
            first = float((loss if penalty is None else loss + penalty).detach())
        stepper.backward(loss, last=True, penalty=penalty)
    return first


def finetune_and_score(
    prompts: nn.Module,
    regulation: Optional[GradientRegulation],
    loss_fn,
    support,
    query,
    steps: int,
    lr: float,
    momentum: float,
    labels_of=lambda b: b["label"],
) -> float:
    """Query accuracy (0-1) after ``steps`` full-batch torch SGD steps (``lr``, ``momentum``) on ``support`` from a
    copy of ``prompts`` (never modified), regulated by ``regulation`` when given, as at test time.
    ``loss_fn(prompts, batch) -> (loss, logits [n, K])``."""
    theta = copy.deepcopy(prompts)
    params = [p for p in theta.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    stepper = RegulatedStepper(theta, optimizer, regulation)  # window 1: R_φ on every step's gradient
    optimizer.zero_grad(set_to_none=True)  # (a copied θ may carry its gradient along)
    for _ in range(steps):
        step_on_batch(stepper, loss_fn, theta, support)
    with torch.no_grad():
        _, logits = loss_fn(theta, query)
    return accuracy(logits, labels_of(query))
