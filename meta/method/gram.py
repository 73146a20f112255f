"""GRAM's bi-level meta-learner (paper Algorithm 1) on top of ``learn2learn.algorithms.GBML``.

Per task t the inner loop (Eq. 7, :mod:`meta.method.inner`) takes ``inner_steps`` regulated steps
θ'_t = θ − α · R_φ(∇_θ L(θ, D_support_t)), heavy-ball SGD with ``inner_momentum`` μ as the test-time optimiser
(v ← μ v + ĝ, θ ← θ − α v, v = 0 at the start of every task; no effect with one step).  The outer loop (Eqs. 8-9)
updates θ with lr λ1 and φ with lr λ2 from ``Σ_t L(θ'_t, D_query_t)``, second order by default; the outer loss and
its optional term (``query_before_weight`` w: ``+ w · L(θ, D_query_t)``, θ asked to be good before any step, where a
downstream schedule with a tiny warm-up lr leaves it) are :class:`meta.method.objective.OuterObjective`, shared with
the task-stacked loop (:mod:`meta.method.batched`).

GBML wraps only θ, the regulators R_φ are its per-parameter transforms and the frozen CLIP lives outside, so
``GBML.clone()`` copies θ (and the small φ) per task.  One backward per task frees its graph before the next, unless
``task_batching`` stacks the tasks into one pass; second order runs the support forward under SDPA's MATH kernel
(the fused kernels have no double backward).
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from meta.method import batched
from meta.method._l2l import l2l
from meta.method.inner import SUPPORT_MODES, InnerRule, LossFn, inner_loop, support_windows, task_loss_of
from meta.method.metrics import accuracy
from meta.method.objective import OuterObjective
from meta.method.prompts import PromptParams
from meta.method.regulator import GradientRegulator, RegulatorFactory, RegulatorSpec
from meta.model import precision
from meta.model.layer_norm import closed_form_layer_norm

# Default weight of the before-adaptation query loss (MetaSpec.query_before_weight, META.QUERY_BEFORE_WEIGHT, the
# demo): chosen on validation splits with the test-time switches of meta.finetune.regulated
# (docs/notes/gram_training_match.md).
DEFAULT_QUERY_BEFORE_WEIGHT = 0.0


@dataclass
class MetaSpec:
    """Hyper-parameters of the bi-level loop: the inner rule, the outer objective, precision and task batching
    (values the paper does not give are ours).  The outer optimiser's are :class:`meta.metatrain.outer.OuterSpec`."""

    inner_steps: int = 1
    inner_lr: float = 0.1  # α
    first_order: bool = False
    regulate: bool = True  # False = "w/o gradient regulating" ablation (raw inner gradient)
    regulator: RegulatorSpec = field(default_factory=RegulatorSpec)
    autocast: str = "none"  # none | bf16 | fp16 forward passes (CUDA; meta.model.precision); fp16 adds a GradScaler
    inner_momentum: float = 0.0  # μ of heavy-ball inner SGD (test-time SGD uses 0.9); 0 = plain steps
    query_before_weight: float = DEFAULT_QUERY_BEFORE_WEIGHT  # w of L_q(θ) in the outer objective (0 = Eq. 8)
    inner_weight_decay: float = 0.0  # λ of the inner SGD (added to R_φ(g), as torch SGD at test time); 0 = none
    inner_support: str = "repeat"  # data per inner step: repeat = whole support | split = K class-balanced windows
    task_batching: str = "auto"  # auto | on | off: a meta-batch's tasks as one stacked pass (meta.method.batched)
    support_attention_lowp: bool = False  # second-order support attention in the autocast/weights dtype, not fp32
    closed_form_layer_norm: bool = False  # second-order support LayerNorms with a closed-form double backward

    def __post_init__(self) -> None:
        if not 0.0 <= self.inner_momentum < 1.0:
            raise ValueError(f"MetaSpec.inner_momentum must be in [0, 1), got {self.inner_momentum}")
        if self.inner_weight_decay < 0:
            raise ValueError(f"MetaSpec.inner_weight_decay must be >= 0, got {self.inner_weight_decay}")
        if self.inner_support not in SUPPORT_MODES:
            raise ValueError(f"MetaSpec.inner_support must be one of {SUPPORT_MODES}, got {self.inner_support!r}")
        if self.query_before_weight < 0:
            raise ValueError(f"MetaSpec.query_before_weight must be >= 0, got {self.query_before_weight}")
        if self.task_batching not in batched.TASK_BATCHING:
            raise ValueError(
                f"MetaSpec.task_batching must be one of {', '.join(batched.TASK_BATCHING)}, got {self.task_batching!r}"
            )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["regulator"] = self.regulator.as_dict()
        return d


@dataclass
class TaskBatch:
    """One task's support and query data in whatever form ``loss_fn`` understands."""

    support: Any
    query: Any


@contextmanager
def double_backward_attention(low_precision: bool = False) -> Iterator[None]:
    """Run attention with the MATH SDPA kernel (the one with a double backward).

    That kernel upcasts bf16/fp16 queries, keys and values to fp32 for its products and softmax (PyTorch's
    ``_scaled_dot_product_attention_math`` in pytorch/pytorch aten/src/ATen/native/transformers/attention.cpp), so
    under autocast the support pass's attention runs fp32 matrix products without tensor cores.  ``low_precision``
    keeps them in the inputs' dtype (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``, process-wide,
    restored on exit); fp32 inputs are unaffected either way.
    """
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    with sdpa_kernel(SDPBackend.MATH):
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(bool(low_precision))
        try:
            yield
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)


class GRAMMetaLearner(nn.Module):
    """θ (``prompts``, moved into the wrapper; the frozen CLIP stays outside) wrapped in learn2learn's ``GBML`` whose
    per-tensor transforms are the regulators R_φ, with the bi-level loop's settings ``spec`` and ``labels_of(batch) ->
    [n]`` integer labels for accuracies.  Per task, :meth:`adapt` clones θ and unrolls the regulated inner loop on the
    support; :meth:`accumulate` backpropagates the query loss at θ' into θ and φ.  The outer update (optimiser,
    clipping, fp16 loss scaling) is the caller's, as in learn2learn: :class:`meta.metatrain.outer.OuterStep`.  Example::

        learner = GRAMMetaLearner(theta, MetaSpec(inner_lr=0.1))
        outer = OuterStep(learner)                                           # Adam on θ (λ1) and φ (λ2)
        loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text))
        metrics = outer.meta_step([TaskBatch(support, query)], loss_fn)     # one outer update of θ and φ
        adapted, losses, accs = learner.adapt(loss_fn, support)              # θ' = θ − α R_φ(∇L_s), connected
    """

    def __init__(
        self,
        prompts: PromptParams,
        spec: Optional[MetaSpec] = None,
        labels_of: Callable[[Any], torch.Tensor] = lambda b: b["label"],
        objective: Optional[Any] = None,
    ):
        super().__init__()
        self.spec = spec or MetaSpec()
        self.labels_of = labels_of
        self._objective = objective  # None: the spec's (OuterObjective); e.g. meta.metatrain's TestTimeObjective
        factory = RegulatorFactory(self.spec.regulator, enabled=self.spec.regulate)
        self.gbml = l2l.algorithms.GBML(
            module=prompts,
            transform=factory,
            lr=self.spec.inner_lr,
            adapt_transform=False,
            first_order=self.spec.first_order,
        )
        self.task_batching = batched.TaskBatching(self.spec.task_batching)  # stacked or sequential meta-batch
        precision.check_autocast(self.spec.autocast, "autocast")

    # ----- precision ---------------------------------------------------------------
    def cast(self):
        """Autocast context of the forward passes (``spec.autocast`` on θ's device; a no-op for ``none``)."""
        if self.spec.autocast == "none":
            return contextlib.nullcontext()
        return precision.autocast(self.spec.autocast, next(self.prompt_module.parameters()).device)

    # ----- views -------------------------------------------------------------------
    @property
    def task_chunk(self) -> Optional[int]:
        """Tasks per stacked pass after an out-of-memory fallback (None = the whole meta-batch; read-only)."""
        return self.task_batching.chunk

    @property
    def prompt_module(self) -> PromptParams:
        """θ (the live meta-parameters)."""
        return self.gbml.module

    def regulators(self) -> dict[str, GradientRegulator]:
        """``{prompt parameter name: R_φ}`` (empty when regulation is off)."""
        update = self.gbml.compute_update
        pairs = zip(self.prompt_module.named_parameters(), update.transforms_indices)
        return {name: update.transforms_modules[i] for (name, _), i in pairs if i is not None}

    @property
    def objective(self) -> OuterObjective:
        """The outer loss: the one given at construction, else ``spec``'s
        (:class:`~meta.method.objective.OuterObjective`, shared by both task loops).  Any object with its
        ``backward`` serves; only ``OuterObjective`` stacks tasks."""
        return OuterObjective.of(self.spec) if self._objective is None else self._objective

    # ----- inner loop --------------------------------------------------------------
    def adapt(
        self, loss_fn: LossFn, support: Any, first_order: Optional[bool] = None, steps: Optional[int] = None
    ) -> tuple[l2l.algorithms.GBML, list[float], list[float]]:
        """Clone θ and take ``inner_steps`` regulated steps on ``support``: ``(learner, support losses, support
        accuracies)``, measured *before* each step; ``learner.module`` holds θ' (connected to θ and φ)."""
        learner, losses, accs = self.unroll(loss_fn, support, first_order, steps)
        return learner, [float(x) for x in losses], [float(x) for x in accs]

    def inner_rule(self) -> InnerRule:
        """The optimiser the inner loop unrolls (:class:`meta.method.inner.InnerRule`): α, μ and λ of ``spec``."""
        return InnerRule(
            lr=self.spec.inner_lr, momentum=self.spec.inner_momentum, weight_decay=self.spec.inner_weight_decay
        )

    def support_forward(self, first_order: bool) -> contextlib.AbstractContextManager:
        """Context of one support forward: autocast; when second order, the MATH attention kernel and (with
        ``spec.closed_form_layer_norm``) LayerNorms with a closed-form double backward (meta.model.layer_norm)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.cast())
        if not first_order:  # only a second-order step differentiates the support gradient again
            stack.enter_context(double_backward_attention(self.spec.support_attention_lowp))
            stack.enter_context(closed_form_layer_norm(self.spec.closed_form_layer_norm))
        return stack

    def unroll(
        self,
        loss_fn: LossFn,
        support: Any,
        first_order: Optional[bool] = None,
        steps: Optional[int] = None,
        start: Optional[l2l.algorithms.GBML] = None,
    ) -> tuple[l2l.algorithms.GBML, list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`adapt` with metrics kept as 0-d tensors (no host sync): clone θ (or adapt ``start``, e.g. θ stacked
        for B tasks by :mod:`meta.method.batched`), deal the support into windows, unroll ``inner_rule()``."""
        first_order = self.spec.first_order if first_order is None else first_order
        learner = self.gbml.clone(first_order=first_order) if start is None else start
        windows = support_windows(support, self.spec.inner_steps if steps is None else steps, self.spec.inner_support)
        losses, accs = inner_loop(
            learner,
            loss_fn,
            windows,
            self.inner_rule(),
            first_order=first_order,
            labels_of=self.labels_of,
            forward_context=lambda: self.support_forward(first_order),
        )
        return learner, losses, accs

    # ----- outer loop --------------------------------------------------------------
    def accumulate(
        self,
        tasks: Sequence[TaskBatch],
        loss_fn: LossFn,
        detailed: bool = False,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    ) -> dict[str, float]:
        """Leave ``∇_{θ,φ} (1/B) Σ_t L_out,t`` in ``.grad`` (:attr:`objective`, one backward per task and term;
        ``backward``: the outer step's, e.g. fp16-scaled) and return task-averaged metrics.

        With ``detailed``, also (at extra cost) the query loss/accuracy at θ, the support loss/accuracy at θ' and the
        cosine between the regulated support update (θ − θ')/α and the query gradient at θ (the paper's Fig. 3b).
        """
        self.train()
        self.zero_grad(set_to_none=True)
        n_tasks = len(tasks)
        if n_tasks == 0:
            raise ValueError("meta-batch is empty")
        if not detailed:  # all tasks in one stacked pass when spec.task_batching allows (None: one by one)
            stacked = self.task_batching.accumulate(self, tasks, loss_fn, backward)
            if stacked is not None:
                return stacked
        # metrics stay on the device as 0-d tensors; one host transfer at the end of the meta-batch
        per_task: dict[str, list] = {}
        for task in tasks:
            learner, values = self.objective.backward(
                self, loss_fn, task.support, task.query, n_tasks, backward=backward
            )
            if detailed and learner is not None:  # an objective without one adapted clone has no diagnostics
                values.update(self._diagnostics(learner, loss_fn, task))
            for key, value in values.items():
                per_task.setdefault(key, []).append(torch.as_tensor(value, dtype=torch.float32))
            del learner
        keys = list(per_task)
        means = torch.stack([torch.stack([v.to("cpu") for v in per_task[k]]).mean() for k in keys]).tolist()
        return dict(zip(keys, means))

    def _diagnostics(self, learner: l2l.algorithms.GBML, loss_fn: LossFn, task: TaskBatch) -> dict[str, float]:
        theta = dict(self.prompt_module.named_parameters())
        adapted = dict(learner.module.named_parameters())
        step = self.spec.inner_lr * self.spec.inner_steps
        update = torch.cat([((theta[n] - adapted[n]) / step).detach().flatten() for n in theta])
        probe = self.gbml.clone(first_order=True)
        q_loss, q_logits = task_loss_of(loss_fn)(probe.module, task.query)
        q_grad = torch.autograd.grad(q_loss, list(probe.module.parameters()))
        q_grad = torch.cat([g.flatten() for g in q_grad])
        cos = torch.nn.functional.cosine_similarity(update, q_grad, dim=0)
        with torch.no_grad():
            s_loss, s_logits = loss_fn(learner.module, task.support)
        return {
            "query_loss_before": float(q_loss.detach()),
            "query_acc_before": accuracy(q_logits.detach(), self.labels_of(task.query)),
            "support_loss_after": float(s_loss),
            "support_acc_after": accuracy(s_logits, self.labels_of(task.support)),
            "grad_cosine": float(cos),
        }

    # ----- state -------------------------------------------------------------------
    def state(self) -> dict:
        """θ and φ (``{"gbml": state_dict}``); the outer optimiser's state is :meth:`OuterStep.state`'s."""
        return {"gbml": self.gbml.state_dict()}

    def load_state(self, state: dict) -> None:
        """θ and φ from :meth:`state` (other keys, such as the outer step's, are left to their owner)."""
        self.gbml.load_state_dict(state["gbml"])
