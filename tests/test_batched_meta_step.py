"""The task-batched outer step (meta/method/batched.py) against the sequential one, task by task."""

import copy
import dataclasses

import pytest
import torch

from meta.method import batched
from meta.method.batched import StackedPrompts, batched_classification_loss, batched_loss_of, stack_batches
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.regulator import GradientRegulator, RegulatorSpec

# class names of different token counts, so the B·K text sequences have different EOT positions
TASK_NAMES = [
    ["circle", "square", "triangle"],
    ["red star", "moon", "long thin arrow"],
    ["dot", "big wavy line", "cross"],
]

LEARNERS = {
    "coop": PromptSpec(n_ctx_text=4),
    "vpt_deep": PromptSpec(n_ctx_text=0, n_ctx_vision=2, vision_depth=2),
    "unigram": PromptSpec(n_ctx_text=2, n_ctx_vision=2),
    "ivlp": PromptSpec(n_ctx_text=2, n_ctx_vision=2, text_depth=2, vision_depth=2),
    "maple": PromptSpec(n_ctx_text=2, text_depth=2, coupling="maple"),
}


def _part(names, n_per_class, image_size, gen, features_dim=None):
    k = len(names)
    batch = {"classnames": names, "label": torch.randperm(k * n_per_class, generator=gen) % k}
    if features_dim:
        batch["features"] = torch.nn.functional.normalize(
            torch.randn(k * n_per_class, features_dim, generator=gen), dim=-1
        )
    else:
        batch["images"] = torch.randn(k * n_per_class, 3, image_size, image_size, generator=gen)
    return batch


def _tasks(dims, seed=1, features=False, n_tasks=3):
    gen = torch.Generator().manual_seed(seed)
    fdim = dims.embed_dim if features else None
    return [
        TaskBatch(
            _part(TASK_NAMES[b % 3], 1, dims.image_size, gen, fdim),
            _part(TASK_NAMES[b % 3], 2, dims.image_size, gen, fdim),
        )
        for b in range(n_tasks)
    ]


def _learner(clip, dims, spec, meta_spec):
    gen = torch.Generator().manual_seed(0)
    ml = GRAMMetaLearner(PromptParams.from_spec(spec, clip, dims, generator=gen), meta_spec)
    with torch.no_grad():  # a non-trivial R_φ (the zero init is the identity and would hide per-task errors)
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    return ml


def _grads(ml):
    out = {f"theta.{n}": p.grad.clone() for n, p in ml.prompt_module.named_parameters()}
    for name, reg in ml.regulators().items():
        out.update({f"phi.{name}.{k}": p.grad.clone() for k, p in reg.named_parameters()})
    return out


def _run_both(tiny_clip, spec, meta_spec, tasks, dtype=torch.float32):
    clip, dims = tiny_clip
    results = []
    for mode in ("off", "on"):
        ml = _learner(clip, dims, spec, dataclasses.replace(meta_spec, task_batching=mode)).to(dtype)
        loss_fn = classification_loss(PromptedCLIP(clip, dims, ml.prompt_module.n_ctx_text))
        metrics = ml.accumulate(tasks, loss_fn)
        results.append((metrics, _grads(ml)))
    return results


def _assert_equal(seq, bat, tol=2e-5, atol=1e-8):
    """Same metric keys and values; every gradient within ``tol`` x its largest entry (float rounding:
    the stacked text batch is truncated at the longest EOT of all tasks, so sums run in another order)."""
    (m_seq, g_seq), (m_bat, g_bat) = seq, bat
    assert m_seq.keys() == m_bat.keys()
    for key in m_seq:
        assert m_bat[key] == pytest.approx(m_seq[key], rel=tol, abs=tol), key
    assert g_seq.keys() == g_bat.keys() and g_seq
    for key in g_seq:
        scale = float(g_seq[key].abs().max())
        assert scale > 0, f"{key}: no gradient on the sequential path"
        err = float((g_bat[key] - g_seq[key]).abs().max())
        assert err <= tol * scale + atol, f"{key}: max error {err:.3g} against largest entry {scale:.3g}"


@pytest.mark.parametrize("first_order", [False, True], ids=["second", "first"])
@pytest.mark.parametrize("learner", list(LEARNERS))
def test_batched_step_equals_sequential(tiny_clip, learner, first_order):
    """Query losses and accuracies, θ and φ gradients of 3 tasks: one stacked pass = three passes."""
    meta_spec = MetaSpec(inner_lr=0.5, first_order=first_order)
    seq, bat = _run_both(tiny_clip, LEARNERS[learner], meta_spec, _tasks(tiny_clip[1]))
    _assert_equal(seq, bat)


@pytest.mark.parametrize("learner", ["unigram", "maple"])
def test_batched_step_equals_sequential_float64(tiny_clip, learner):
    """In float64 the two paths agree to 1e-10 of each gradient's scale: the same function, not an approximation."""
    clip64 = copy.deepcopy(tiny_clip[0]).double()
    tasks = [
        TaskBatch(*[{k: v.double() if k == "images" else v for k, v in part.items()} for part in (t.support, t.query)])
        for t in _tasks(tiny_clip[1])
    ]
    seq, bat = _run_both((clip64, tiny_clip[1]), LEARNERS[learner], MetaSpec(inner_lr=0.5), tasks, torch.float64)
    _assert_equal(seq, bat, tol=1e-10, atol=0.0)


def test_batched_step_equals_sequential_two_steps_momentum_regulator_options(tiny_clip):
    """Two inner steps with momentum, a non-identity R_φ and the before-adaptation term, in float64 (the algebra
    itself, as the test above checks it)."""
    meta_spec = MetaSpec(
        inner_lr=0.5,
        inner_steps=2,
        inner_momentum=0.9,
        query_before_weight=0.5,
        regulator=RegulatorSpec(init="normal", init_std=0.3),
    )
    clip64 = copy.deepcopy(tiny_clip[0]).double()
    tasks = [
        TaskBatch(*[{k: v.double() if k == "images" else v for k, v in part.items()} for part in (t.support, t.query)])
        for t in _tasks(tiny_clip[1])
    ]
    seq, bat = _run_both((clip64, tiny_clip[1]), LEARNERS["unigram"], meta_spec, tasks, torch.float64)
    _assert_equal(seq, bat, tol=1e-10, atol=0.0)


def test_batched_step_equals_sequential_cached_features(tiny_clip):
    """Text-only prompts on cached image features ([B, n, E] stacked)."""
    seq, bat = _run_both(tiny_clip, LEARNERS["coop"], MetaSpec(inner_lr=0.5), _tasks(tiny_clip[1], features=True))
    _assert_equal(seq, bat)


def test_batched_loss_is_the_sum_of_task_losses(tiny_clip):
    """The batched loss of distinct per-task prompts = Σ_b the per-task loss at task b's prompts."""
    clip, dims = tiny_clip
    pclip = PromptedCLIP(clip, dims, 2)
    theta = PromptParams.from_spec(LEARNERS["ivlp"], clip, dims, generator=torch.Generator().manual_seed(3))
    tasks = _tasks(dims, seed=4)
    gen = torch.Generator().manual_seed(5)
    stacked = StackedPrompts.expand(theta, 3)
    stacked = StackedPrompts(
        {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in stacked.named_parameters()}, 3
    )
    loss, logits = batched_classification_loss(pclip)(stacked, stack_batches([t.query for t in tasks]))
    per_task = classification_loss(pclip)
    ref = [per_task(_View({n: t[b] for n, t in stacked.named_parameters()}), tasks[b].query) for b in range(3)]
    torch.testing.assert_close(loss, sum(r[0] for r in ref), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, torch.stack([r[1] for r in ref]), rtol=1e-5, atol=1e-5)


class _View:
    """Attribute access like PromptParams, for one task's unstacked tensors."""

    def __init__(self, tensors):
        for name in ("ctx", "vpt", "ctx_deep", "proj_weight", "proj_bias"):
            setattr(self, name, tensors.get(name))


def test_regulator_task_dims_regulates_each_task_alone():
    """R_φ with task_dims = 1 on a [B, ...] gradient = R_φ of each slice (rms per task)."""
    torch.manual_seed(0)
    reg = GradientRegulator(6, RegulatorSpec(init="normal", init_std=0.3))
    grads = torch.randn(3, 2, 4, 6) * torch.tensor([1e-4, 1.0, 30.0]).view(3, 1, 1, 1)  # very different scales
    reg.task_dims = 1
    stacked = reg(grads)
    reg.task_dims = 0
    for b in range(3):
        torch.testing.assert_close(stacked[b], reg(grads[b]))
    whole = reg(grads)  # the whole-tensor rms: the small-scale task gets a different answer
    assert not torch.allclose(whole[0], stacked[0], rtol=1e-3, atol=0)


def test_unequal_tasks_fall_back_to_sequential(tiny_clip):
    """Tasks of different sizes do not stack; the step runs task by task and gives the sequential numbers."""
    clip, dims = tiny_clip
    tasks = _tasks(dims)
    gen = torch.Generator().manual_seed(9)
    tasks[1] = TaskBatch(_part(TASK_NAMES[1], 2, dims.image_size, gen), tasks[1].query)
    assert stack_batches([t.support for t in tasks]) is None
    seq, bat = _run_both(tiny_clip, LEARNERS["coop"], MetaSpec(inner_lr=0.5), tasks)
    for key in seq[1]:
        assert torch.equal(seq[1][key], bat[1][key]), key


def test_auto_is_sequential_on_the_cpu(tiny_clip):
    """auto leaves CPU runs on the sequential path (bit-equal to off), so CPU results keep their last digit."""
    clip, dims = tiny_clip
    tasks = _tasks(dims, n_tasks=3)
    out, stacked_calls = {}, {}
    for mode in ("off", "auto", "on"):
        ml = _learner(clip, dims, LEARNERS["coop"], MetaSpec(inner_lr=0.5, task_batching=mode))
        loss_fn = classification_loss(PromptedCLIP(clip, dims, ml.prompt_module.n_ctx_text))
        inner, calls = batched_loss_of(loss_fn), []
        loss_fn.batched = lambda prompts, batch, inner=inner, calls=calls: calls.append(1) or inner(prompts, batch)
        out[mode] = (ml.accumulate(tasks, loss_fn), _grads(ml))
        stacked_calls[mode] = len(calls)
    assert stacked_calls == {"off": 0, "auto": 0, "on": stacked_calls["on"]} and stacked_calls["on"] > 0
    assert out["auto"][0] == out["off"][0]
    assert all(torch.equal(out["auto"][1][k], out["off"][1][k]) for k in out["off"][1])


def test_auto_halves_the_chunk_on_out_of_memory(tiny_clip, monkeypatch):
    """auto (on an accelerator): a stacked pass that runs out of memory is retried in halves; gradients match."""
    monkeypatch.setattr(batched, "on_accelerator", lambda learner: True)
    clip, dims = tiny_clip
    tasks = _tasks(dims, n_tasks=4)
    spec = LEARNERS["vpt_deep"]
    ref = _learner(clip, dims, spec, MetaSpec(inner_lr=0.5, task_batching="off"))
    pclip = PromptedCLIP(clip, dims, 0)
    m_ref = ref.accumulate(tasks, classification_loss(pclip))
    ml = _learner(clip, dims, spec, MetaSpec(inner_lr=0.5, task_batching="auto"))
    loss_fn = classification_loss(pclip)
    inner, seen = batched_loss_of(loss_fn), []

    def limited(prompts, batch):  # pretends more than 2 tasks at once do not fit
        seen.append(batch["label"].shape[0])
        if batch["label"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return inner(prompts, batch)

    loss_fn.batched = limited
    metrics = ml.accumulate(tasks, loss_fn)
    assert ml.task_chunk == 2 and seen[0] == 4 and set(seen[1:]) == {2}
    _assert_equal((m_ref, _grads(ref)), (metrics, _grads(ml)))
    with pytest.raises(torch.OutOfMemoryError):  # "on" does not hide the error
        ml2 = _learner(clip, dims, spec, MetaSpec(inner_lr=0.5, task_batching="on"))
        ml2.accumulate(tasks, loss_fn)


def test_task_batching_value_checked():
    with pytest.raises(ValueError, match="task_batching"):
        MetaSpec(task_batching="yes")


def test_objectives_the_stacked_pass_does_not_compute_run_sequentially(tiny_clip):
    """Split support windows (a switch of the regulated inner loop) are not stacked."""
    from meta.method import batched

    clip, dims = tiny_clip
    tasks = _tasks(dims)
    ml = _learner(clip, dims, LEARNERS["coop"], MetaSpec(inner_lr=0.5, task_batching="on"))
    loss_fn = classification_loss(PromptedCLIP(clip, dims, 4))
    assert batched.stacked_objective(ml.spec)
    assert ml.task_batching.accumulate(ml, tasks, loss_fn) is not None
    spec = MetaSpec(inner_lr=0.5, task_batching="on", inner_support="split")
    ml.spec = spec
    assert not batched.stacked_objective(spec)
    assert ml.task_batching.accumulate(ml, tasks, loss_fn) is None
