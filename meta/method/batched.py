"""Task-batched outer step: B tasks of one meta-batch adapted and scored in one pass each.

All tasks of a meta-batch start from the same θ.  Stacking θ into ``[B, ...]`` tensors (one slice per
task, :class:`StackedPrompts`, connected to θ by ``expand``) and summing the tasks' losses,

    L(θ_1..θ_B) = Σ_b L_b(θ_b)       so       ∂L/∂θ_b = ∇L_b(θ_b)

because task b's loss reads only slice b.  The inner loop then runs unchanged on the stacked learner (a GBML clone
whose R_φ clones act per task: :attr:`meta.method.regulator.GradientRegulator.task_dims`), and one batched forward
scores every task's θ'_b (:meth:`meta.method.learners.PromptLearner.stacked_features`).  The gradient of ``(1/B) Σ_b
L_q,b(θ'_b)`` reaches θ through ``expand`` as the sum over tasks, exactly what one backward per task accumulates.

Shapes (B tasks, K classes, n images per task): a stacked batch holds ``classnames`` (B lists of K names), ``label``
``[B, n]`` and ``images`` ``[B·n, 3, H, W]`` (task-major) or ``features`` ``[B, n, E]``; the batched loss is
``(Σ_b mean_i CE_b,i, logits [B, n, K])``.

:func:`stack_batches` returns ``None`` when tasks differ in shape (then the sequential path runs).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meta.method.learners import DEFAULT_LEARNER, feature_logits, learner_of
from meta.method.objective import OuterObjective
from meta.method.prompts import PromptedCLIP
from meta.method.regulator import GradientRegulator

log = logging.getLogger(__name__)

# batched_loss_fn(stacked prompts, stacked batch) -> (sum of the B task losses, logits [B, n, K])
BatchedLossFn = Callable[[nn.Module, dict], tuple[torch.Tensor, torch.Tensor]]

TASK_BATCHING = ("auto", "on", "off")


class StackedPrompts(nn.Module):
    """θ of B tasks: each prompt tensor of a :class:`meta.method.prompts.PromptParams` with a leading task dim
    (``ctx`` ``[B, M, d_t]``, ...; absent ones ``None``).  They sit in ``_parameters`` in θ's parameter order, as
    learn2learn's clones hold theirs, so GBML's ``update_module`` treats them as the clone's parameters; ``learner``
    is θ's, so the same :class:`meta.method.learners.PromptLearner` prompts the towers."""

    def __init__(self, tensors: dict[str, Optional[torch.Tensor]], n_tasks: int, learner: str = DEFAULT_LEARNER):
        super().__init__()
        self.n_tasks = n_tasks
        self.learner = learner
        for name, value in tensors.items():
            if value is not None and value.shape[0] != n_tasks:
                raise ValueError(f"stacked {name} must lead with {n_tasks} tasks, got {tuple(value.shape)}")
            self._parameters[name] = value

    @classmethod
    def expand(cls, prompts: nn.Module, n_tasks: int) -> "StackedPrompts":
        """B views of ``prompts``' tensors (``expand``: no copy; gradients reach them summed over tasks)."""
        tensors = dict(prompts._parameters)
        return cls(
            {n: None if t is None else t.unsqueeze(0).expand(n_tasks, *t.shape) for n, t in tensors.items()},
            n_tasks,
            getattr(prompts, "learner", DEFAULT_LEARNER),
        )

    def task(self, b: int) -> "StackedPrompts":
        """Task b's tensors as a one-task view (for tests and diagnostics)."""
        return StackedPrompts(
            {n: None if t is None else t[b : b + 1] for n, t in self._parameters.items()}, 1, self.learner
        )


def stack_batches(batches: Sequence[dict]) -> Optional[dict]:
    """One stacked batch from B task batches of equal shape (module docstring), or ``None`` when the tasks differ in
    image count, class count, input kind or image size."""
    first = batches[0]
    kind = "images" if first.get("images") is not None else "features"
    if first.get(kind) is None:
        return None
    shape = tuple(first[kind].shape)
    n_cls = len(first["classnames"])
    for batch in batches:
        if (
            batch.get(kind) is None
            or tuple(batch[kind].shape) != shape
            or len(batch["classnames"]) != n_cls
            or tuple(batch["label"].shape) != tuple(first["label"].shape)
        ):
            return None
    values = [b[kind] for b in batches]
    stacked = torch.cat(values) if kind == "images" else torch.stack(values)
    return {
        "classnames": [list(b["classnames"]) for b in batches],
        kind: stacked,
        "label": torch.stack([b["label"] for b in batches]),
    }


def features(pclip: PromptedCLIP, prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image [B, n, E], text [B, K, E] or per image [B, n, K, E])`` of a stacked batch, by θ's learner
    (:meth:`meta.method.learners.PromptLearner.stacked_features`)."""
    return learner_of(prompts).stacked_features(
        pclip, prompts, batch["classnames"], images=batch.get("images"), image_features=batch.get("features")
    )


def batched_classification_loss(pclip: PromptedCLIP) -> BatchedLossFn:
    """The batched twin of :func:`meta.method.prompts.classification_loss`: ``(Σ_b L_b, logits [B, n, K])``, ``L_b``
    task b's mean cross-entropy, exactly as the per-task loss computes it."""

    def loss_fn(prompts: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = feature_logits(pclip.logit_scale, *features(pclip, prompts, batch))  # [B, n, K]
        per_image = F.cross_entropy(logits.transpose(1, 2), batch["label"], reduction="none")  # [B, n]
        return per_image.mean(dim=1).sum(), logits

    return loss_fn


def stacked_learner(gbml: nn.Module, n_tasks: int, first_order: bool) -> nn.Module:
    """A learn2learn clone of ``gbml`` whose module is θ stacked for ``n_tasks`` tasks; its R_φ clones regulate each
    task's slice on its own (``task_dims = 1``), the originals are untouched."""
    learner = gbml.clone(first_order=first_order)
    learner.module = StackedPrompts.expand(learner.module, n_tasks)
    for module in learner.compute_update.modules():
        if isinstance(module, GradientRegulator):
            module.task_dims = 1
    return learner


class TaskBatching:
    """How a meta-learner runs its meta-batch: ``mode`` (``auto`` | ``on`` | ``off``, :data:`TASK_BATCHING`) and
    ``chunk``, the most tasks one stacked pass may hold after an out-of-memory fallback (``None`` = all of them).

    The learner owns one (``GRAMMetaLearner.task_batching``); only :meth:`accumulate` changes ``chunk``.
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode not in TASK_BATCHING:
            raise ValueError(f"task_batching must be one of {', '.join(TASK_BATCHING)}, got {mode!r}")
        self.mode = mode
        self.chunk: Optional[int] = None

    def accumulate(
        self, learner: Any, tasks: Sequence[Any], loss_fn: Callable, backward: Callable = torch.Tensor.backward
    ) -> Optional[dict[str, float]]:
        """:meth:`meta.method.gram.GRAMMetaLearner.accumulate` over task-stacked chunks (the same ``.grad`` and
        task-averaged metrics), or ``None``: run it sequentially.

        ``on``: all tasks in one chunk; ``auto``: the same on an accelerator, halving the chunk (:attr:`chunk`) on
        out-of-memory, and sequential on the CPU (CPU results keep their last digit).  ``None`` also for ``off``, one
        task, tasks of different shapes, no batched twin of ``loss_fn``, a False :func:`stacked_objective` or an
        objective that is not an :class:`~meta.method.objective.OuterObjective` (``META.MODE testtime``).
        """
        fn = batched_loss_of(loss_fn)
        stackable = isinstance(learner.objective, OuterObjective) and stacked_objective(learner.spec)
        if self.mode == "off" or fn is None or len(tasks) < 2 or not stackable:
            return None
        if self.mode == "auto" and not on_accelerator(learner):
            return None
        supports = stack_batches([t.support for t in tasks])
        queries = stack_batches([t.query for t in tasks])
        if supports is None or queries is None:
            return None
        while True:
            chunk = min(len(tasks), self.chunk or len(tasks))
            if chunk < 2:
                return None
            try:
                return _accumulate_chunks(learner, tasks, fn, chunk, backward)
            except RuntimeError as err:
                if self.mode != "auto" or not is_out_of_memory(err):
                    raise
                del err
                learner.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.chunk = chunk // 2
                log.warning(
                    "task-batched outer step out of memory with %d tasks at once: %s",
                    chunk,
                    f"{chunk // 2} from now on" if chunk // 2 > 1 else "sequential from now on",
                )


def on_accelerator(learner: Any) -> bool:
    """Whether θ lives on an accelerator (``auto`` stacks tasks there only)."""
    return next(learner.prompt_module.parameters()).device.type != "cpu"


def stacked_objective(spec: Any) -> bool:
    """Whether the stacked pass computes ``spec``'s outer objective: the whole support in every inner step.
    ``inner_support`` other than ``repeat`` (a class-balanced split of a stacked batch would mix tasks) runs
    sequentially."""
    return spec.inner_support == "repeat"


def _accumulate_chunks(
    learner: Any, tasks: Sequence[Any], fn: BatchedLossFn, chunk: int, backward: Callable
) -> dict[str, float]:
    """The batched outer step over consecutive chunks of at most ``chunk`` tasks (:meth:`TaskBatching.accumulate`)."""
    learner.zero_grad(set_to_none=True)
    n_tasks = len(tasks)
    first_order = learner.spec.first_order
    sums: dict[str, torch.Tensor] = {}
    objective = learner.objective
    for start, stop in chunks(n_tasks, chunk):
        size = stop - start
        support = stack_batches([t.support for t in tasks[start:stop]])
        query = stack_batches([t.query for t in tasks[start:stop]])
        start_learner = stacked_learner(learner.gbml, size, first_order)
        adapted, values = objective.backward(
            learner,
            fn,
            support,
            query,
            n_tasks,
            start=start_learner,
            before=lambda size=size: StackedPrompts.expand(learner.prompt_module, size),
            backward=backward,
        )
        # losses are sums over the chunk's tasks, accuracies means over its (equal-sized) tasks
        for key in ("support_acc_before", "query_acc_after"):
            values[key] = values[key] * size
        for key, value in values.items():
            value = value.detach().float()
            sums[key] = value if key not in sums else sums[key] + value
        del adapted
    keys = list(sums)
    means = (torch.stack([sums[k].to("cpu") for k in keys]) / n_tasks).tolist()
    return dict(zip(keys, means))


def batched_loss_of(loss_fn: Callable) -> Optional[BatchedLossFn]:
    """The batched twin of ``loss_fn``, or ``None``: ``loss_fn.batched`` when set, else built (once) from the
    ``PromptedCLIP`` that :func:`meta.method.prompts.classification_loss` attaches as ``loss_fn.pclip``."""
    fn = getattr(loss_fn, "batched", None)
    if getattr(loss_fn, "consistency", None) is not None:
        return None  # the stacked twin computes the cross-entropy only: the consistency terms run task by task
    if fn is None and isinstance(getattr(loss_fn, "pclip", None), PromptedCLIP):
        fn = loss_fn.batched = batched_classification_loss(loss_fn.pclip)
    return fn


def chunks(n_tasks: int, size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n_tasks)`` in runs of at most ``size``."""
    return [(s, min(s + size, n_tasks)) for s in range(0, n_tasks, size)]


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an accelerator out-of-memory error (the auto mode then halves the task chunk)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
