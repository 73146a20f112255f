"""R_φ as a gate on a regulariser's gradient (``META.REGULATOR.FORM gate``, meta.method.regulator.GradientGate).

The gate is checked against its formula written out here, the inner step against a step written by hand from
two autograd gradients, the meta-gradient (second order) against finite differences in float64, the test-time
stepper and launch step against the formula, and the init file round trip.
"""

import pytest
import torch
import torch.nn.functional as F

from meta.finetune.init_io import InitMismatchError, export_gram_init, load_gram_init
from meta.finetune.regulated import GradientRegulation, LaunchStep, RegulatedStepper, launch_, step_on_batch
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.prompts import PromptParams
from meta.method.regulator import GradientGate, RegulatorSpec
from meta.model.backbone import ClipDims

GATE = RegulatorSpec(form="gate", gate_group=2, init="normal", init_std=0.5)


def _by_formula(gate: GradientGate, g_task: torch.Tensor, g_reg: torch.Tensor) -> torch.Tensor:
    """g_task + repeat(2 σ(W [g_task / rms; g_reg / rms]), G) ⊙ g_reg, every step spelled out."""
    u_task = g_task / torch.sqrt((g_task**2).mean() + 1e-12)
    u_reg = g_reg / torch.sqrt((g_reg**2).mean() + 1e-12)
    z = torch.cat([u_task, u_reg], dim=-1) @ gate.gate.weight.T  # [..., dim / G]
    a = 2.0 / (1.0 + torch.exp(-z))
    expanded = torch.stack([a] * gate.group, dim=-1).flatten(-2)  # each value over G consecutive coordinates
    return g_task + expanded * g_reg


def _toy(dtype=torch.float64, weight=0.7, seed=0):
    """θ = ctx [3, 4]; task = cross-entropy of tanh(x @ ctxᵀ) · 3; regulariser = weight · ‖ctx − c₀‖² (c₀ fixed)."""
    g = torch.Generator().manual_seed(seed)
    prompts = PromptParams(ctx=(torch.randn(3, 4, generator=g) * 0.5).to(dtype))
    anchor = torch.randn(3, 4, generator=g).to(dtype)

    def batch(n):
        return {"x": torch.randn(n, 4, generator=g).to(dtype), "label": torch.randint(0, 3, (n,), generator=g)}

    def task_loss(module, b):
        logits = torch.tanh(b["x"] @ module.ctx.T) * 3.0
        return F.cross_entropy(logits, b["label"]), logits

    def parts(module, b):
        task, logits = task_loss(module, b)
        return task, weight * (module.ctx - anchor).pow(2).sum(), logits

    def loss_fn(module, b):
        task, penalty, logits = parts(module, b)
        return task + penalty, logits

    loss_fn.parts, loss_fn.task_loss = parts, task_loss
    return prompts, batch, loss_fn


def test_gate_matches_its_formula_starts_as_the_plain_sum_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    gate = GradientGate(8, GATE)
    g_task, g_reg = torch.randn(3, 8), torch.randn(3, 8) * 1e-3
    torch.testing.assert_close(gate(g_task, g_reg), _by_formula(gate, g_task, g_reg))
    assert tuple(gate.gate.weight.shape) == (4, 16) and list(gate.state_dict()) == ["gate.weight"]
    # the gate value does not depend on either gradient's scale
    torch.testing.assert_close(gate.gate_value(g_task * 1e4, g_reg * 10), gate.gate_value(g_task, g_reg))
    zero = GradientGate(8, RegulatorSpec(form="gate", gate_group=2))
    assert torch.equal(zero(g_task, g_reg), g_task + g_reg)  # a = 2 σ(0) = 1: the fixed-λ gradient
    assert torch.equal(gate(g_task), g_task)  # no regulariser: the task gradient as it is
    with pytest.raises(ValueError, match="GATE_GROUP"):
        GradientGate(6, RegulatorSpec(form="gate", gate_group=4))
    assert "gate_group" not in RegulatorSpec().as_dict() and RegulatorSpec(form="gate").as_dict()["gate_group"] == 8


def test_inner_step_keeps_the_task_gradient_and_gates_the_regulariser_gradient():
    prompts, batch, loss_fn = _toy()
    learner = GRAMMetaLearner(prompts, MetaSpec(inner_steps=1, inner_lr=0.3, regulator=GATE)).double()
    gate = learner.regulators()["ctx"]
    assert isinstance(gate, GradientGate)
    support = batch(6)
    adapted, _, _ = learner.adapt(loss_fn, support, first_order=False)
    module = PromptParams(ctx=learner.prompt_module.ctx.detach().clone())
    theta = module.ctx
    task, penalty, _ = loss_fn.parts(module, support)
    (g_task,) = torch.autograd.grad(task, [theta])
    (g_reg,) = torch.autograd.grad(penalty, [theta])
    with torch.no_grad():
        expected = theta - 0.3 * _by_formula(gate, g_task, g_reg)
    torch.testing.assert_close(adapted.module.ctx.detach(), expected)
    # the gate really acts: the plain sum (fixed λ) gives another step
    assert not torch.allclose(expected, theta.detach() - 0.3 * (g_task + g_reg))


@pytest.mark.parametrize("inner_steps, momentum", [(1, 0.0), (2, 0.9)])
def test_meta_gradient_through_the_gate_matches_finite_differences_of_the_query_task_loss(inner_steps, momentum):
    """accumulate() leaves ∇ L_q,task(θ'(θ, φ)) in .grad: second order through both gradients and the gate, and the
    query measures the task alone (the regulariser is a support-side term)."""
    prompts, batch, loss_fn = _toy()
    spec = MetaSpec(inner_steps=inner_steps, inner_lr=0.3, inner_momentum=momentum, regulator=GATE)
    learner = GRAMMetaLearner(prompts, spec).double()
    gate = learner.regulators()["ctx"]
    task = TaskBatch(batch(6), batch(9))
    learner.accumulate([task], loss_fn)
    tensors = {"gate.weight": gate.gate.weight, "ctx": learner.prompt_module.ctx}
    grads = {name: t.grad.detach().clone() for name, t in tensors.items()}

    def query_task_loss() -> float:
        adapted, _, _ = learner.adapt(loss_fn, task.support, first_order=False)
        return float(loss_fn.task_loss(adapted.module, task.query)[0])

    eps = 1e-6
    g = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        assert float(grads[name].abs().max()) > 0, name
        direction = torch.randn(tensor.shape, generator=g, dtype=tensor.dtype)
        values = []
        for shift in (eps, -2 * eps):
            with torch.no_grad():
                tensor += shift * direction
            values.append(query_task_loss())
        with torch.no_grad():
            tensor += eps * direction
        fd = (values[0] - values[1]) / (2 * eps)
        assert float((grads[name] * direction).sum()) == pytest.approx(fd, rel=1e-5, abs=1e-9), name


def test_first_order_gate_still_learns_and_a_loss_without_parts_is_refused_naming_the_keys():
    prompts, batch, loss_fn = _toy()
    learner = GRAMMetaLearner(prompts, MetaSpec(inner_lr=0.3, first_order=True, regulator=GATE)).double()
    learner.accumulate([TaskBatch(batch(6), batch(9))], loss_fn)
    assert float(learner.regulators()["ctx"].gate.weight.grad.abs().max()) > 0
    with pytest.raises(ValueError, match="META.CONSISTENCY.TEXT_WEIGHT"):
        learner.adapt(loss_fn.task_loss, batch(6))


def test_test_time_stepper_and_launch_apply_the_gate_to_the_window_mean():
    prompts, batch, loss_fn = _toy(torch.float32)
    torch.manual_seed(0)
    gate = GradientGate(4, GATE)
    regulation = GradientRegulation({"ctx": gate})
    assert regulation.gated
    theta = PromptParams(ctx=prompts.ctx.detach().clone())
    start = theta.ctx.detach().clone()
    b1, b2 = batch(4), batch(5)
    # by hand: both passes at the same θ, gradients summed; n · R_φ(mean task, mean regulariser)
    sums = []
    for part in (0, 1):
        total = 0
        for b in (b1, b2):
            module = PromptParams(ctx=start.clone().requires_grad_())
            (grad,) = torch.autograd.grad(loss_fn.parts(module, b)[part], [module.ctx])
            total = total + grad
        sums.append(total)
    expected = start - 0.1 * 2 * _by_formula(gate, sums[0] / 2, sums[1] / 2)
    optimizer = torch.optim.SGD(theta.parameters(), lr=0.1)
    stepper = RegulatedStepper(theta, optimizer, regulation, window=2)
    assert stepper.wants_parts
    assert step_on_batch(stepper, loss_fn, theta, b1)[0].shape == ()
    assert torch.equal(theta.ctx.detach(), start)  # the window is still open
    step_on_batch(stepper, loss_fn, theta, b2)
    torch.testing.assert_close(theta.ctx.detach(), expected)
    with pytest.raises(ValueError, match="CONSISTENCY_TEXT"):
        stepper.backward(loss_fn.task_loss(theta, b1)[0])  # no regulariser for the gate: one message
    # the launch step replays the meta-trained inner step on the loss in parts
    launched = PromptParams(ctx=start.clone())
    launch_(launched, regulation, lambda m: loss_fn.parts(m, b1)[:2], LaunchStep(alpha=0.3))
    module = PromptParams(ctx=start.clone().requires_grad_())
    g_task, g_reg = (torch.autograd.grad(x, [module.ctx])[0] for x in loss_fn.parts(module, b1)[:2])
    torch.testing.assert_close(launched.ctx.detach(), start - 0.3 * _by_formula(gate, g_task, g_reg))


def test_gate_round_trips_through_the_init_file_and_a_bad_group_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    prompts = PromptParams(ctx=torch.randn(4, 16))
    gate = GradientGate(16, RegulatorSpec(form="gate", gate_group=4, init="normal"))
    dims = ClipDims(
        model_name="toy",
        text_width=16,
        vision_width=8,
        embed_dim=8,
        context_length=77,
        text_layers=1,
        vision_layers=1,
        image_size=32,
        num_patches=4,
    )
    path = export_gram_init(tmp_path / "gate.safetensors", prompts, {"ctx": gate}, dims)
    init = load_gram_init(path)
    assert init.metadata["regulator"]["form"] == "gate" and init.metadata["regulator"]["gate_group"] == 4
    again = init.regulator_modules()["ctx"]
    assert isinstance(again, GradientGate) and torch.equal(again.gate.weight, gate.gate.weight)
    g_task, g_reg = torch.randn(4, 16), torch.randn(4, 16)
    assert torch.equal(again(g_task, g_reg), gate(g_task, g_reg))
    bad = GradientGate(16, RegulatorSpec(form="gate", gate_group=4))
    bad.spec = RegulatorSpec(form="gate", gate_group=3)  # a header whose group does not divide the width
    bad_path = export_gram_init(tmp_path / "bad.safetensors", prompts, {"ctx": bad}, dims)
    with pytest.raises(InitMismatchError, match="regulator.ctx.*GATE_GROUP"):
        load_gram_init(bad_path)
