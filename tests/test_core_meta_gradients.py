"""The GBML meta-gradient path against an independent second-order computation."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from meta.gram import GRAMMetaLearner, MetaSpec, TaskBatch, double_backward_attention
from meta.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.regulator import RegulatorSpec

NAMES = ["circle", "square", "triangle"]


def _batch(n_per_class, image_size, gen, dtype=torch.float32):
    k = len(NAMES)
    return {"classnames": NAMES,
            "images": torch.randn(n_per_class * k, 3, image_size, image_size, generator=gen, dtype=dtype),
            "label": torch.arange(k).repeat(n_per_class)}


def _learner(clip, dims, spec, meta_spec, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    prompts = PromptParams.from_spec(spec, clip, dims, generator=gen).to(dtype)
    ml = GRAMMetaLearner(prompts, meta_spec).to(dtype)
    # a non-trivial regulator (the zero init is the identity and would hide bugs)
    with torch.no_grad():
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    return ml


def _reference_meta_grads(pclip, ml, support, query, alpha):
    """Hand-written: θ' = θ − α R_φ(∇θ L_s), grads of L_q(θ') w.r.t. θ and φ."""
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

    with double_backward_attention():
        l_s = loss(theta, support)
    grads = torch.autograd.grad(l_s, [theta[n] for n in names], create_graph=True)
    adapted = {n: theta[n] - alpha * functional_call(regs[n], phi[n], (g,)) for n, g in zip(names, grads)}
    l_q = loss(adapted, query)
    flat_phi = [(n, k, v) for n in names for k, v in phi[n].items()]
    out = torch.autograd.grad(l_q, [theta[n] for n in names] + [v for _, _, v in flat_phi])
    g_theta = dict(zip(names, out[:len(names)]))
    g_phi = {(n, k): g for (n, k, _), g in zip(flat_phi, out[len(names):])}
    return g_theta, g_phi


@pytest.mark.parametrize("spec", [PromptSpec(n_ctx_text=4),
                                  PromptSpec(n_ctx_text=0, n_ctx_vision=2, vision_depth=2),
                                  PromptSpec(n_ctx_text=2, n_ctx_vision=2)],
                         ids=["coop", "deep-vpt", "unigram"])
def test_gbml_meta_gradients_match_hand_written_second_order(tiny_clip, spec):
    clip, dims = tiny_clip
    meta_spec = MetaSpec(inner_lr=0.5, regulator=RegulatorSpec(form="residual"))
    ml = _learner(clip, dims, spec, meta_spec)
    pclip = PromptedCLIP(clip, dims, ml.prompt_module.n_ctx_text)
    gen = torch.Generator().manual_seed(1)
    support, query = _batch(1, dims.image_size, gen), _batch(2, dims.image_size, gen)

    ml.accumulate([TaskBatch(support, query)], classification_loss(pclip))
    ref_theta, ref_phi = _reference_meta_grads(pclip, ml, support, query, meta_spec.inner_lr)

    for name, p in ml.prompt_module.named_parameters():
        torch.testing.assert_close(p.grad, ref_theta[name], rtol=1e-5, atol=1e-8)
    regs = ml.regulators()
    for (name, key), ref in ref_phi.items():
        got = dict(regs[name].named_parameters())[key].grad
        assert got is not None, f"φ {name}.{key} received no gradient"
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)


def test_directional_derivative_matches_finite_difference_float64(tiny_clip):
    clip64 = copy.deepcopy(tiny_clip[0]).double()
    dims = tiny_clip[1]
    meta_spec = MetaSpec(inner_lr=0.5)
    ml = _learner(clip64, dims, PromptSpec(n_ctx_text=2, n_ctx_vision=2), meta_spec, dtype=torch.float64)
    pclip = PromptedCLIP(clip64, dims, 2)
    loss_fn = classification_loss(pclip)
    gen = torch.Generator().manual_seed(3)
    support = _batch(1, dims.image_size, gen, torch.float64)
    query = _batch(2, dims.image_size, gen, torch.float64)
    task = TaskBatch(support, query)

    params = [p for g in ml.optimizer.param_groups for p in g["params"]]
    ml.accumulate([task], loss_fn)
    analytic_dirs = [p.grad.clone() for p in params]
    direction = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    analytic = sum((g * d).sum() for g, d in zip(analytic_dirs, direction))

    def objective():
        learner, _, _ = ml.adapt(loss_fn, support)
        return float(loss_fn(learner.module, query)[0].detach())

    def shifted(eps):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(eps * d)
        value = objective()
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.sub_(eps * d)
        return value

    # central differences converge as eps^2 here (measured: error 4e-5, 4e-7, 4e-9 at eps 1e-5, 1e-6, 1e-7)
    eps = 1e-6
    numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
    assert abs(numeric - float(analytic)) <= 1e-6 * max(1.0, abs(numeric)), (numeric, float(analytic))


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
    assert [g["name"] for g in ml.optimizer.param_groups] == ["prompt"]
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
    spec = MetaSpec(outer_lr_prompt=1e-2, outer_lr_regulator=1e-4, grad_clip=0.0)
    ml = _learner(clip, dims, PromptSpec(n_ctx_text=4), spec)
    lrs = {g["name"]: g["lr"] for g in ml.optimizer.param_groups}
    assert lrs == {"prompt": 1e-2, "regulator": 1e-4}
    pclip = PromptedCLIP(clip, dims, 4)
    loss_fn = classification_loss(pclip)
    gen = torch.Generator().manual_seed(9)
    task = TaskBatch(_batch(1, dims.image_size, gen), _batch(1, dims.image_size, gen))
    before = ml.prompt_module.ctx.detach().clone()
    m = ml.meta_step([task], loss_fn)
    assert m["skipped"] == 0.0 and not torch.equal(before, ml.prompt_module.ctx.detach())

    def nan_loss(prompts, batch):
        loss, logits = loss_fn(prompts, batch)
        return loss * float("nan"), logits

    before = ml.prompt_module.ctx.detach().clone()
    m = ml.meta_step([task], nan_loss)
    assert m["skipped"] == 1.0 and ml.skipped_steps == 1
    assert torch.equal(before, ml.prompt_module.ctx.detach())
