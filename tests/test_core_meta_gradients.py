"""The GBML meta-gradient path against an independent second-order computation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_central_differences, class_batch
from torch.func import functional_call

from meta.metatrain.outer import OuterSpec, OuterStep
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch, double_backward_attention
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.regulator import RegulatorSpec

_batch = class_batch


def _learner(clip, dims, spec, meta_spec, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    prompts = PromptParams.from_spec(spec, clip, dims, generator=gen).to(dtype)
    ml = GRAMMetaLearner(prompts, meta_spec).to(dtype)
    # a non-trivial regulator (the zero init is the identity and would hide bugs)
    with torch.no_grad():
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    return ml


def _reference_meta_grads(pclip, ml, support, query, alpha, steps=1):
    """Hand-written: ``steps`` times θ ← θ − α R_φ(∇θ L_s(θ)); grads of L_q(θ') w.r.t. θ and φ.

    Returns ``(g_theta, g_phi, adapted)`` with ``adapted`` the detached θ' (one tensor per name).
    """
    names = [n for n, _ in ml.prompt_module.named_parameters()]
    theta = {n: p.detach().clone().requires_grad_(True) for n, p in ml.prompt_module.named_parameters()}
    regs = ml.regulators()
    phi = {n: {k: v.detach().clone().requires_grad_(True) for k, v in regs[n].named_parameters()} for n in names}

    class View:  # attribute access like PromptParams
        def __init__(self, d):
            self.ctx = d.get("ctx")
            self.vpt = d.get("vpt")

    def loss(params, batch):
        logits = pclip.logits(View(params), batch["classnames"], images=batch["images"])
        return F.cross_entropy(logits, batch["label"])

    adapted = dict(theta)
    for _ in range(steps):
        with double_backward_attention():
            l_s = loss(adapted, support)
        grads = torch.autograd.grad(l_s, [adapted[n] for n in names], create_graph=True)
        adapted = {n: adapted[n] - alpha * functional_call(regs[n], phi[n], (g,)) for n, g in zip(names, grads)}
    l_q = loss(adapted, query)
    flat_phi = [(n, k, v) for n in names for k, v in phi[n].items()]
    out = torch.autograd.grad(l_q, [theta[n] for n in names] + [v for _, _, v in flat_phi])
    g_theta = dict(zip(names, out[: len(names)]))
    g_phi = {(n, k): g for (n, k, _), g in zip(flat_phi, out[len(names) :])}
    return g_theta, g_phi, {n: t.detach() for n, t in adapted.items()}


@pytest.mark.parametrize(
    "spec",
    [
        PromptSpec(n_ctx_text=4),
        PromptSpec(n_ctx_text=0, n_ctx_vision=2, vision_depth=2),
        PromptSpec(n_ctx_text=2, n_ctx_vision=2),
    ],
    ids=["coop", "deep-vpt", "unigram"],
)
def test_gbml_meta_gradients_match_hand_written_second_order(tiny_clip, spec):
    clip, dims = tiny_clip
    meta_spec = MetaSpec(inner_lr=0.5, regulator=RegulatorSpec(form="residual"))
    ml = _learner(clip, dims, spec, meta_spec)
    pclip = PromptedCLIP(clip, dims, ml.prompt_module.n_ctx_text)
    gen = torch.Generator().manual_seed(1)
    support, query = _batch(1, dims.image_size, gen), _batch(2, dims.image_size, gen)

    ml.accumulate([TaskBatch(support, query)], classification_loss(pclip))
    ref_theta, ref_phi, _ = _reference_meta_grads(pclip, ml, support, query, meta_spec.inner_lr)

    for name, p in ml.prompt_module.named_parameters():
        torch.testing.assert_close(p.grad, ref_theta[name], rtol=1e-5, atol=1e-8)
    regs = ml.regulators()
    for (name, key), ref in ref_phi.items():
        got = dict(regs[name].named_parameters())[key].grad
        assert got is not None, f"φ {name}.{key} received no gradient"
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)


def test_two_inner_steps_match_hand_written_second_order_float64(tiny_clip):
    """inner_steps = 2: θ' and the meta-gradients equal two hand-unrolled regulated steps."""
    clip64 = copy.deepcopy(tiny_clip[0]).double()
    dims = tiny_clip[1]
    spec = PromptSpec(n_ctx_text=2, n_ctx_vision=2)
    meta_spec = MetaSpec(inner_lr=0.5, inner_steps=2, regulator=RegulatorSpec(form="residual"))
    ml = _learner(clip64, dims, spec, meta_spec, dtype=torch.float64)
    pclip = PromptedCLIP(clip64, dims, ml.prompt_module.n_ctx_text)
    loss_fn = classification_loss(pclip)
    gen = torch.Generator().manual_seed(11)
    support = _batch(1, dims.image_size, gen, torch.float64)
    query = _batch(2, dims.image_size, gen, torch.float64)

    learner, losses, _ = ml.adapt(loss_fn, support)
    assert len(losses) == 2 and losses[1] != losses[0]  # two steps taken, the second from the moved θ
    _, _, ref_adapted = _reference_meta_grads(pclip, ml, support, query, meta_spec.inner_lr, steps=2)
    _, _, one_step = _reference_meta_grads(pclip, ml, support, query, meta_spec.inner_lr, steps=1)
    got = dict(learner.module.named_parameters())
    for name, ref in ref_adapted.items():
        torch.testing.assert_close(got[name].detach(), ref, rtol=1e-10, atol=1e-12)
        assert (ref - one_step[name]).abs().max() > 1e-6, f"{name}: the second step did not move θ'"

    ml.accumulate([TaskBatch(support, query)], loss_fn)
    ref_theta, ref_phi, _ = _reference_meta_grads(pclip, ml, support, query, meta_spec.inner_lr, steps=2)
    for name, p in ml.prompt_module.named_parameters():
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, ref_theta[name], rtol=1e-9, atol=1e-12)
    regs = ml.regulators()
    for (name, key), ref in ref_phi.items():
        grad = dict(regs[name].named_parameters())[key].grad
        assert grad is not None and grad.abs().sum() > 0, f"φ {name}.{key} received no gradient"
        torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_directional_derivative_matches_finite_difference_float64(tiny_clip, inner_steps):
    clip64 = copy.deepcopy(tiny_clip[0]).double()
    dims = tiny_clip[1]
    meta_spec = MetaSpec(inner_lr=0.5, inner_steps=inner_steps)
    ml = _learner(clip64, dims, PromptSpec(n_ctx_text=2, n_ctx_vision=2), meta_spec, dtype=torch.float64)
    pclip = PromptedCLIP(clip64, dims, 2)
    loss_fn = classification_loss(pclip)
    gen = torch.Generator().manual_seed(3)
    support = _batch(1, dims.image_size, gen, torch.float64)
    query = _batch(2, dims.image_size, gen, torch.float64)
    task = TaskBatch(support, query)

    groups = {g["name"]: list(g["params"]) for g in OuterStep(ml).optimizer.param_groups}
    assert set(groups) == {"prompt", "regulator"}
    params = [p for ps in groups.values() for p in ps]
    ml.accumulate([task], loss_fn)
    analytic_dirs = [p.grad.clone() for p in params]
    for name, ps in groups.items():  # θ and φ are both connected to the query loss
        assert all(p.grad.abs().sum() > 0 for p in ps), f"{name}: zero meta-gradient"

    def objective():
        learner, _, _ = ml.adapt(loss_fn, support)
        return float(loss_fn(learner.module, query)[0].detach())

    # directions along θ only, φ only, and both; central differences converge as eps^2 here
    # (measured, one step, both: error 4e-5, 4e-7, 4e-9 at eps 1e-5, 1e-6, 1e-7)
    member = {name: [any(p is q for q in ps) for p in params] for name, ps in groups.items()}
    masks = {**member, "both": [True] * len(params)}
    assert_matches_central_differences(objective, params, analytic_dirs, masks, gen, eps=1e-6)


def test_first_order_differs_from_second_order(tiny_clip):
    clip, dims = tiny_clip
    gen = torch.Generator().manual_seed(5)
    support, query = _batch(1, dims.image_size, gen), _batch(2, dims.image_size, gen)
    grads = {}
    for first_order in (False, True):
        ml = _learner(clip, dims, PromptSpec(n_ctx_text=4), MetaSpec(inner_lr=0.5, first_order=first_order))
        pclip = PromptedCLIP(clip, dims, 4)
        ml.accumulate([TaskBatch(support, query)], classification_loss(pclip))
        grads[first_order] = ml.prompt_module.ctx.grad.clone()
        phi_grads = [p.grad for p in ml.gbml.compute_update.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in phi_grads), "φ must get a gradient in both modes"
    rel = (grads[True] - grads[False]).norm() / grads[False].norm()
    assert rel > 1e-4, f"first- and second-order θ gradients coincide (rel diff {rel:.2e})"


def test_regulation_off_builds_no_regulator_and_uses_raw_gradient(tiny_clip):
    clip, dims = tiny_clip
    ml = _learner(clip, dims, PromptSpec(n_ctx_text=4), MetaSpec(inner_lr=0.5, regulate=False))
    assert ml.regulators() == {}
    assert [g["name"] for g in OuterStep(ml).optimizer.param_groups] == ["prompt"]
    pclip = PromptedCLIP(clip, dims, 4)
    loss_fn = classification_loss(pclip)
    gen = torch.Generator().manual_seed(7)
    support = _batch(1, dims.image_size, gen)
    theta = ml.prompt_module.ctx.detach().clone().requires_grad_(True)

    class View:
        ctx = theta
        vpt = None

    with double_backward_attention():  # same attention kernel as the inner loop
        raw = torch.autograd.grad(loss_fn(View, support)[0], theta)[0]
    learner, _, _ = ml.adapt(loss_fn, support)
    torch.testing.assert_close(learner.module.ctx.detach(), theta.detach() - 0.5 * raw, rtol=1e-5, atol=1e-7)


def test_outer_step_uses_separate_learning_rates_and_skips_non_finite(tiny_clip):
    clip, dims = tiny_clip
    ml = _learner(clip, dims, PromptSpec(n_ctx_text=4), MetaSpec())
    outer = OuterStep(ml, OuterSpec(outer_lr_prompt=1e-2, outer_lr_regulator=1e-4, grad_clip=0.0))
    lrs = {g["name"]: g["lr"] for g in outer.optimizer.param_groups}
    assert lrs == {"prompt": 1e-2, "regulator": 1e-4}
    pclip = PromptedCLIP(clip, dims, 4)
    loss_fn = classification_loss(pclip)
    gen = torch.Generator().manual_seed(9)
    task = TaskBatch(_batch(1, dims.image_size, gen), _batch(1, dims.image_size, gen))
    before = ml.prompt_module.ctx.detach().clone()
    m = outer.meta_step([task], loss_fn)
    assert m["skipped"] == 0.0 and not torch.equal(before, ml.prompt_module.ctx.detach())

    def nan_loss(prompts, batch):
        loss, logits = loss_fn(prompts, batch)
        return loss * float("nan"), logits

    before = ml.prompt_module.ctx.detach().clone()
    m = outer.meta_step([task], nan_loss)
    assert m["skipped"] == 1.0 and outer.skipped_steps == 1
    assert torch.equal(before, ml.prompt_module.ctx.detach())
