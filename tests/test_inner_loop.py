"""The inner loop (meta.method.inner) and the regulator switches against independent computations.

* K = 1 equals the step GRAMMetaLearner took before the inner loop was factored out (GBML.adapt), bit for bit.
* K windows of heavy-ball SGD with weight decay (second and first order) equal a hand-rolled torch.autograd
  unroll written from the formulas, θ' and the meta-gradients of θ and φ.
* The halves of R_φ (γ only, β only), the learned per-tensor step size (Meta-SGD) and the β part of ĝ equal
  the formulas evaluated by hand from the regulator's weights; the step size survives the init file.
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
    gamma = 1.0 + reg.spec.gamma_bound * torch.tanh(u @ reg.gamma.weight.T + reg.gamma.bias)
    beta = rms * torch.tanh(u @ reg.beta.weight.T + reg.beta.bias)
    return gamma, beta


@pytest.mark.parametrize("halves", ["both", "gamma", "beta"])
@pytest.mark.parametrize("learn_lr", [False, True])
def test_regulator_halves_and_step_size_by_hand(halves, learn_lr):
    torch.manual_seed(0)
    reg = GradientRegulator(6, RegulatorSpec(init="normal", init_std=0.3, halves=halves, learn_lr=learn_lr)).double()
    if learn_lr:
        with torch.no_grad():
            reg.log_lr.fill_(-0.7)
    g = torch.randn(4, 6, dtype=torch.float64) * 1e-3
    gamma, beta = _by_hand(reg, g)
    want = {"both": gamma * g + beta, "gamma": gamma * g, "beta": g + beta}[halves]
    want_b = {"both": beta, "gamma": torch.zeros_like(g), "beta": beta}[halves]
    scale = torch.exp(torch.tensor(-0.7, dtype=torch.float64)) if learn_lr else 1.0
    out, b = reg.parts(g)
    torch.testing.assert_close(out, scale * want, rtol=1e-12, atol=0)
    torch.testing.assert_close(b, scale * want_b, rtol=1e-12, atol=0)
    torch.testing.assert_close(reg(g), out, rtol=0, atol=0)


def test_beta_part_with_norm_preserve_and_mix():
    torch.manual_seed(1)
    reg = GradientRegulator(
        5, RegulatorSpec(init="normal", init_std=0.3, norm_preserve=True, mix=True, mix_init=0.4)
    ).double()
    g = torch.randn(3, 5, dtype=torch.float64)
    gamma, beta = _by_hand(reg, g)
    raw = gamma * g + beta
    k = g.norm() / raw.norm()
    c = torch.sigmoid(reg.mix_logit.detach())  # m = 0.4 stored in float32, then cast
    out, b = reg.parts(g)
    torch.testing.assert_close(out, (1 - c) * k * raw + c * g, rtol=1e-12, atol=0)
    torch.testing.assert_close(b, (1 - c) * k * beta, rtol=1e-12, atol=0)


def test_learned_step_size_gets_meta_gradient_and_survives_the_init_file(tiny_clip, tmp_path):
    from meta.finetune.init_io import export_gram_init, load_gram_init
    from meta.finetune.regulated import GradientRegulation

    spec = MetaSpec(inner_lr=0.3, regulator=RegulatorSpec(learn_lr=True, halves="gamma"))
    ml, _, loss_fn, dims = _setup(tiny_clip, spec)
    gen = torch.Generator().manual_seed(5)
    ml.accumulate([TaskBatch(_batch(1, dims.image_size, gen), _batch(2, dims.image_size, gen))], loss_fn)
    regs = ml.regulators()
    assert all(r.log_lr.grad is not None and r.log_lr.grad.abs() > 0 for r in regs.values())
    with torch.no_grad():
        for i, r in enumerate(regs.values()):
            r.log_lr.fill_(0.25 + i)
    path = export_gram_init(tmp_path / "init.safetensors", ml.prompt_module, regs, tiny_clip[1])
    loaded = load_gram_init(path).regulator_modules()
    assert set(loaded) == set(regs)
    for name, reg in loaded.items():
        assert reg.spec.learn_lr and reg.spec.halves == "gamma"
        assert float(reg.log_lr) == pytest.approx(float(regs[name].log_lr), abs=1e-6)
        g = torch.randn(3, reg.dim)
        # the test-time regulation applies the step size with the rest of R_φ (no engine change)
        p = torch.nn.Parameter(torch.zeros(3, reg.dim))
        p.grad = g.clone()
        GradientRegulation({name: reg}).apply_([(name, p)])
        torch.testing.assert_close(p.grad, reg.float()(g), rtol=1e-6, atol=1e-8)
        gamma, _ = _by_hand(reg.float(), g)
        torch.testing.assert_close(p.grad, torch.exp(reg.log_lr.detach()) * gamma * g, rtol=1e-5, atol=1e-8)


def test_trajectory_states_term_matches_hand_rolled(tiny_clip):
    """WarpGrad-style term: detached states of a regulated heavy-ball run, one regulated step from each, query
    loss; it adds exactly the hand-rolled φ gradient and nothing to θ's."""
    common = dict(inner_lr=0.3, inner_steps=2, inner_momentum=0.9, inner_weight_decay=0.01, inner_support="split")
    on, pclip, loss_fn, dims = _setup(tiny_clip, MetaSpec(**common, trajectory_states=2, trajectory_windows=3))
    off, _, _, _ = _setup(tiny_clip, MetaSpec(**common))
    assert on.objective.trajectory_steps() == [2, 3]
    gen = torch.Generator().manual_seed(6)
    support, query = _batch(2, dims.image_size, gen), _batch(2, dims.image_size, gen)
    on.accumulate([TaskBatch(support, query)], loss_fn)
    off.accumulate([TaskBatch(support, query)], loss_fn)
    for (name, a), b in zip(on.prompt_module.named_parameters(), off.prompt_module.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)

    names = [n for n, _ in on.prompt_module.named_parameters()]
    regs = on.regulators()
    phi = {n: {k: v.detach().clone().requires_grad_(True) for k, v in regs[n].named_parameters()} for n in names}
    windows = support_windows(support, 2, "split")

    def loss(params, batch):
        return F.cross_entropy(pclip.logits(_View(params), batch["classnames"], images=batch["images"]), batch["label"])

    def regulated(params, batch, graph):
        grads = torch.autograd.grad(loss(params, batch), [params[n] for n in names])
        return {
            n: functional_call(regs[n], phi[n] if graph else {k: v.detach() for k, v in phi[n].items()}, (g,))
            + 0.01 * params[n]
            for n, g in zip(names, grads)
        }

    theta = {n: p.detach().clone().requires_grad_(True) for n, p in on.prompt_module.named_parameters()}
    vel, states = None, {}
    for t in range(3):
        d = regulated(theta, windows[t % 2], graph=False)
        vel = d if vel is None else {n: 0.9 * vel[n] + d[n] for n in names}
        theta = {n: (theta[n] - 0.3 * vel[n]).detach().requires_grad_(True) for n in names}
        states[t + 1] = theta
    total = 0.0
    for t in (2, 3):
        d = regulated(states[t], windows[t % 2], graph=True)
        total = total + loss({n: states[t][n] - 0.3 * d[n] for n in names}, query) / 2
    flat = [(n, k, v) for n in names for k, v in phi[n].items()]
    ref = torch.autograd.grad(total, [v for *_, v in flat])
    off_regs = off.regulators()
    for (n, k, _), g in zip(flat, ref):
        got = dict(regs[n].named_parameters())[k].grad - dict(off_regs[n].named_parameters())[k].grad
        assert g.abs().sum() > 0
        torch.testing.assert_close(got, g, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("rule", [InnerRule(0.4), InnerRule(0.4, 0.9, 0.05)], ids=["sgd", "momentum_wd"])
def test_launch_step_takes_the_inner_loops_steps(tiny_clip, rule):
    """One rule: the launch step at test time (meta.finetune.regulated.launch_, in place, R_φ through
    GradientRegulation)
    lands where the first-order inner loop of meta-training lands from the same θ, R_φ and data (repeat mode)."""
    from meta.finetune.regulated import GradientRegulation, LaunchStep, launch_

    ml, _, loss_fn, dims = _setup(tiny_clip, MetaSpec(inner_lr=rule.lr))
    support = _batch(2, dims.image_size, torch.Generator().manual_seed(5))
    learner = ml.gbml.clone(first_order=True)
    inner_loop(learner, loss_fn, support_windows(support, 3, "repeat"), rule, first_order=True)
    expected = {n: p.detach() for n, p in learner.module.named_parameters()}
    theta = copy.deepcopy(ml.prompt_module)
    step = LaunchStep(rule.lr, steps=3, momentum=rule.momentum, weight_decay=rule.weight_decay)
    assert step.rule == rule
    launch_(theta, GradientRegulation(ml.regulators()), lambda p: loss_fn(p, support)[0], step)
    for name, p in theta.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-12, atol=1e-12)
    assert (expected["ctx"] - ml.prompt_module.ctx.detach()).abs().max() > 1e-4  # the steps moved θ


def test_weighted_sum_of_batch_losses_and_of_gate_parts():
    """The launch's mean loss over batches: Σ w_b loss_b for one loss and part by part for the gate's pair."""
    from meta.finetune.regulated import weighted_sum

    a, b = torch.tensor(2.0), torch.tensor(5.0)
    assert float(weighted_sum([(a, 0.25), (b, 0.75)])) == 0.25 * 2.0 + 0.75 * 5.0
    task, penalty = weighted_sum([((a, b), 0.5), ((b, a), 0.5)])
    assert float(task) == float(penalty) == 3.5
    with pytest.raises(ValueError, match="no batches"):
        weighted_sum([])
