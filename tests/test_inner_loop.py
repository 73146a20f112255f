"""The inner loop (meta.method.inner) and the regulator switches against independent computations.

* K = 1 equals the step GRAMMetaLearner took before the inner loop was factored out (GBML.adapt), bit for bit.
* K windows of heavy-ball SGD with weight decay (second and first order) equal a hand-rolled torch.autograd
  unroll written from the formulas, θ' and the meta-gradients of θ and φ.
* ĝ and its β part equal the formulas evaluated by hand from the regulator's weights.
"""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers import class_batch
from torch.func import functional_call

from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch, double_backward_attention
from meta.method.inner import InnerRule, inner_loop, support_windows
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.regulator import GradientRegulator, RegulatorSpec

_batch = partial(class_batch, dtype=torch.float64)


def _setup(tiny_clip, meta_spec, seed=0):
    clip = copy.deepcopy(tiny_clip[0]).double()
    dims = tiny_clip[1]
    gen = torch.Generator().manual_seed(seed)
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=2, n_ctx_vision=2), clip, dims, generator=gen).double()
    ml = GRAMMetaLearner(prompts, meta_spec).double()
    with torch.no_grad():  # a non-trivial regulator (the zero init is the identity and would hide bugs)
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    pclip = PromptedCLIP(clip, dims, 2)
    return ml, pclip, classification_loss(pclip), dims


class _View:
    def __init__(self, d):
        self.ctx = d.get("ctx")
        self.vpt = d.get("vpt")


def _reference(pclip, ml, windows, query, rule, first_order):
    """Hand-rolled: u = R(∇L), d = u + λθ, v = μv + d, θ ← θ − αv per window; grads of L_q(θ_K) (θ, φ)."""
    names = [n for n, _ in ml.prompt_module.named_parameters()]
    theta = {n: p.detach().clone().requires_grad_(True) for n, p in ml.prompt_module.named_parameters()}
    regs = ml.regulators()
    phi = {n: {k: v.detach().clone().requires_grad_(True) for k, v in regs[n].named_parameters()} for n in names}

    def loss(params, batch):
        logits = pclip.logits(_View(params), batch["classnames"], images=batch["images"])
        return F.cross_entropy(logits, batch["label"])

    cur, vel = dict(theta), None
    for batch in windows:
        with double_backward_attention():
            l_s = loss(cur, batch)
        grads = torch.autograd.grad(l_s, [cur[n] for n in names], create_graph=not first_order)
        d = {n: functional_call(regs[n], phi[n], (g,)) + rule.weight_decay * cur[n] for n, g in zip(names, grads)}
        vel = d if vel is None else {n: rule.momentum * vel[n] + d[n] for n in names}
        cur = {n: cur[n] - rule.lr * vel[n] for n in names}
    l_q = loss(cur, query)
    flat = [(n, k, v) for n in names for k, v in phi[n].items()]
    out = torch.autograd.grad(l_q, [theta[n] for n in names] + [v for *_, v in flat])
    return (
        dict(zip(names, out[: len(names)])),
        {(n, k): g for (n, k, _), g in zip(flat, out[len(names) :])},
        {n: t.detach() for n, t in cur.items()},
        float(l_q.detach()),
    )


def test_one_step_is_bit_equal_to_gbml_adapt(tiny_clip):
    """K = 1 through inner_loop equals the pre-refactor path (clone, GBML.adapt): θ', query loss, θ and φ grads."""
    ml, _, loss_fn, dims = _setup(tiny_clip, MetaSpec(inner_lr=0.3))
    gen = torch.Generator().manual_seed(1)
    support, query = _batch(1, dims.image_size, gen), _batch(2, dims.image_size, gen)

    def grads_after(adapted):
        q_loss, _ = loss_fn(adapted.module, query)
        params = list(ml.prompt_module.parameters()) + list(ml.gbml.compute_update.parameters())
        return q_loss.detach(), torch.autograd.grad(q_loss, params), [p.detach() for p in adapted.module.parameters()]

    old = ml.gbml.clone(first_order=False)
    with double_backward_attention():
        s_loss, _ = loss_fn(old.module, support)
    old.adapt(s_loss, first_order=False)
    ref_loss, ref_grads, ref_theta = grads_after(old)
    new, losses, _ = ml.unroll(loss_fn, support)
    got_loss, got_grads, got_theta = grads_after(new)
    assert torch.equal(losses[0], s_loss.detach())
    assert torch.equal(got_loss, ref_loss)
    for a, b in zip(got_theta + list(got_grads), ref_theta + list(ref_grads)):
        assert torch.equal(a, b)
    assert all(g.abs().sum() > 0 for g in got_grads)


@pytest.mark.parametrize("first_order", [False, True], ids=["second-order", "first-order"])
def test_k_window_unroll_matches_hand_rolled(tiny_clip, first_order):
    """K = 3 split windows, momentum 0.9, weight decay, its own lr: θ_K and the meta-gradients equal the formulas."""
    spec = MetaSpec(
        inner_lr=0.4,
        inner_steps=3,
        inner_momentum=0.9,
        inner_weight_decay=0.05,
        inner_support="split",
        first_order=first_order,
    )
    ml, pclip, loss_fn, dims = _setup(tiny_clip, spec)
    gen = torch.Generator().manual_seed(2)
    support, query = _batch(3, dims.image_size, gen), _batch(2, dims.image_size, gen)
    windows = support_windows(support, 3, "split")

    ml.accumulate([TaskBatch(support, query)], loss_fn)
    ref_theta, ref_phi, ref_adapted, ref_q = _reference(pclip, ml, windows, query, ml.inner_rule(), first_order)
    learner, losses, _ = ml.adapt(loss_fn, support)
    assert len(losses) == 3 and len(set(losses)) == 3
    for name, p in learner.module.named_parameters():
        torch.testing.assert_close(p.detach(), ref_adapted[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(float(loss_fn(learner.module, query)[0].detach()), ref_q, rtol=1e-10, atol=1e-12)
    for name, p in ml.prompt_module.named_parameters():
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, ref_theta[name], rtol=1e-8, atol=1e-12)
    regs = ml.regulators()
    for (name, key), ref in ref_phi.items():
        grad = dict(regs[name].named_parameters())[key].grad
        assert grad is not None and grad.abs().sum() > 0, f"φ {name}.{key} got no gradient"
        torch.testing.assert_close(grad, ref, rtol=1e-8, atol=1e-12)


def test_momentum_and_weight_decay_change_the_unroll(tiny_clip):
    """The rule's parts are not dead code: each of μ, λ and the windows moves θ_K."""
    ml, _, loss_fn, dims = _setup(tiny_clip, MetaSpec(inner_lr=0.4))
    gen = torch.Generator().manual_seed(4)
    support = _batch(2, dims.image_size, gen)
    outs = {}
    for name, rule, mode in (
        ("plain", InnerRule(0.4), "repeat"),
        ("mu", InnerRule(0.4, 0.9), "repeat"),
        ("wd", InnerRule(0.4, 0.0, 0.1), "repeat"),
        ("split", InnerRule(0.4), "split"),
    ):
        learner = ml.gbml.clone(first_order=True)
        inner_loop(learner, loss_fn, support_windows(support, 2, mode), rule, first_order=True)
        outs[name] = torch.cat([p.detach().flatten() for p in learner.module.parameters()])
    for name in ("mu", "wd", "split"):
        assert (outs[name] - outs["plain"]).abs().max() > 1e-6, name


def test_support_windows_split_is_class_balanced_and_disjoint():
    feats = torch.arange(12.0).unsqueeze(1)
    support = {"classnames": ["a", "b", "c"], "label": torch.tensor([0] * 4 + [1] * 4 + [2] * 4), "features": feats}
    windows = support_windows(support, 2, "split")
    assert len(windows) == 2
    seen = torch.cat([w["features"].flatten() for w in windows]).sort().values
    assert torch.equal(seen, feats.flatten())
    for w in windows:
        assert w["classnames"] == ["a", "b", "c"]
        assert torch.equal(torch.bincount(w["label"]), torch.tensor([2, 2, 2]))
        assert torch.equal(w["label"], (w["features"].flatten() // 4).long())
    assert support_windows(support, 3, "repeat") == [support] * 3
    with pytest.raises(ValueError, match="META.INNER_SUPPORT split: class 0 has 4 support items"):
        support_windows(support, 5, "split")
    with pytest.raises(ValueError, match="META.INNER_SUPPORT"):
        support_windows(support, 2, "shuffle")


def _by_hand(reg: GradientRegulator, g: torch.Tensor):
    """γ and β of the residual form with rms input norm, from the weights."""
    rms = g.pow(2).mean().add(1e-12).sqrt()
    u = g / rms
    gamma = 1.0 + torch.tanh(u @ reg.gamma.weight.T + reg.gamma.bias)
    beta = rms * torch.tanh(u @ reg.beta.weight.T + reg.beta.bias)
    return gamma, beta


def test_regulated_gradient_and_its_beta_part_by_hand():
    torch.manual_seed(0)
    reg = GradientRegulator(6, RegulatorSpec(init="normal", init_std=0.3)).double()
    g = torch.randn(4, 6, dtype=torch.float64) * 1e-3
    gamma, beta = _by_hand(reg, g)
    out, b = reg.parts(g)
    torch.testing.assert_close(out, gamma * g + beta, rtol=1e-12, atol=0)
    torch.testing.assert_close(b, beta, rtol=1e-12, atol=0)
    torch.testing.assert_close(reg(g), out, rtol=0, atol=0)
