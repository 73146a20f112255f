"""Inner-loop and outer-step options kept after the regulator variants were dropped (docs/evidence.md, "Options
removed"): inner momentum, φ decay; the second-order meta-gradient through R_φ and momentum, the init file round
trip, test-time regulation and its statistics.

Each option is checked against an independent computation, the meta-gradient against finite differences in float64.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from meta.finetune.init_io import export_gram_init, load_gram_init
from meta.finetune.regulated import GradientRegulation, finetune_and_score
from meta.metatrain.outer import OuterSpec, OuterStep
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.prompts import PromptParams
from meta.method.regulator import GradientRegulator, RegulatorSpec
from meta.model.backbone import ClipDims


def _randomise(reg: GradientRegulator, seed: int = 0) -> GradientRegulator:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in reg.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.7)
    return reg


def test_bad_option_values_are_rejected():
    with pytest.raises(ValueError, match="inner_momentum"):
        MetaSpec(inner_momentum=1.0)
    with pytest.raises(ValueError, match="regulator_weight_decay"):
        OuterSpec(regulator_weight_decay=-1.0)


# ------------------------------------------------------------------ meta-learner with a toy loss
def _toy(dtype=torch.float64, seed=0):
    """θ = ctx [3, 4]; a batch is (x [n, 4], labels [n]); logits = x @ ctx.T, cross-entropy."""
    g = torch.Generator().manual_seed(seed)
    prompts = PromptParams(ctx=(torch.randn(3, 4, generator=g) * 0.5).to(dtype))

    def batch(n):
        return {"x": torch.randn(n, 4, generator=g).to(dtype), "label": torch.randint(0, 3, (n,), generator=g)}

    def loss_fn(module, b):
        logits = torch.tanh(b["x"] @ module.ctx.T) * 3.0
        return torch.nn.functional.cross_entropy(logits, b["label"]), logits

    return prompts, batch, loss_fn


def test_inner_momentum_equals_torch_sgd_with_momentum_on_raw_gradients():
    prompts, batch, loss_fn = _toy()
    support = batch(6)
    spec = MetaSpec(inner_steps=3, inner_lr=0.2, inner_momentum=0.9, regulate=False, first_order=True)
    learner = GRAMMetaLearner(prompts, spec)
    adapted, _, _ = learner.adapt(loss_fn, support)
    module = PromptParams(ctx=learner.prompt_module.ctx)  # a copy
    theta = module.ctx
    opt = torch.optim.SGD([theta], lr=0.2, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(module, support)[0].backward()
        opt.step()
    torch.testing.assert_close(adapted.module.ctx.detach(), theta.detach())
    # momentum really matters over several steps
    plain = GRAMMetaLearner(
        PromptParams(ctx=learner.prompt_module.ctx.detach().clone()),
        MetaSpec(inner_steps=3, inner_lr=0.2, regulate=False, first_order=True),
    )
    assert not torch.allclose(plain.adapt(loss_fn, support)[0].module.ctx, adapted.module.ctx)


def _meta_loss(learner, loss_fn, task):
    adapted, _, _ = learner.adapt(loss_fn, task.support, first_order=False)
    return loss_fn(adapted.module, task.query)[0]


def test_second_order_meta_gradient_through_regulator_and_momentum_matches_finite_differences():
    prompts, batch, loss_fn = _toy()
    rspec = RegulatorSpec(init="normal", init_std=0.3)
    spec = MetaSpec(inner_steps=2, inner_lr=0.3, inner_momentum=0.9, regulator=rspec)
    learner = GRAMMetaLearner(prompts, spec).double()
    reg = learner.regulators()["ctx"]
    with torch.no_grad():
        reg.gamma.bias.normal_(0, 0.3)
        reg.beta.bias.normal_(0, 0.3)
    task = TaskBatch(batch(6), batch(9))
    loss = _meta_loss(learner, loss_fn, task)
    tensors = {
        "gamma.weight": reg.gamma.weight,
        "beta.bias": reg.beta.bias,
        "ctx": learner.prompt_module.ctx,
    }
    grads = dict(zip(tensors, torch.autograd.grad(loss, list(tensors.values()))))
    eps = 1e-6
    g = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        assert grads[name] is not None and float(grads[name].abs().max()) > 0, name
        direction = torch.randn(tensor.shape, generator=g, dtype=tensor.dtype)
        values = []
        for shift in (eps, -2 * eps):
            with torch.no_grad():
                tensor += shift * direction
            values.append(float(_meta_loss(learner, loss_fn, task)))
        with torch.no_grad():
            tensor += eps * direction
        up, down = values
        fd = (up - down) / (2 * eps)
        assert float((grads[name] * direction).sum()) == pytest.approx(fd, rel=1e-5, abs=1e-9), name


def test_regulator_weight_decay_pulls_phi_towards_identity_only():
    prompts, batch, loss_fn = _toy(torch.float32)
    learner = GRAMMetaLearner(prompts, MetaSpec(regulator=RegulatorSpec(init="normal", init_std=0.3)))
    outer = OuterStep(learner, OuterSpec(regulator_weight_decay=0.5))
    groups = {g["name"]: g for g in outer.optimizer.param_groups}
    assert groups["regulator"]["weight_decay"] == 0.5 and groups["prompt"]["weight_decay"] == 0
    reg = learner.regulators()["ctx"]
    before = reg.gamma.weight.detach().norm()
    for p in learner.parameters():  # zero task gradient: only the decay acts
        p.grad = torch.zeros_like(p)
    outer.optimizer.step()
    assert float(reg.gamma.weight.norm()) < float(before)


# ------------------------------------------------------------------ test time and files
def _dims():
    return ClipDims(
        model_name="GRAM-Test-Tiny",
        text_width=4,
        vision_width=4,
        embed_dim=4,
        context_length=77,
        text_layers=1,
        vision_layers=1,
        image_size=32,
        num_patches=16,
    )


def test_export_import_round_trip_carries_every_option(tmp_path):
    rspec = RegulatorSpec(form="paper", input_norm=False, beta_scale=0.5, init="normal", init_std=0.2)
    reg = _randomise(GradientRegulator(4, rspec), seed=2)
    path = export_gram_init(tmp_path / "init.safetensors", PromptParams(ctx=torch.randn(3, 4)), {"ctx": reg}, _dims())
    loaded = load_gram_init(path).regulator_modules()["ctx"]
    assert loaded.spec == rspec
    g = torch.randn(3, 4)
    torch.testing.assert_close(loaded(g), reg(g), rtol=0, atol=0)


def test_files_written_before_the_options_still_load_as_before(tmp_path):
    reg = _randomise(GradientRegulator(4, RegulatorSpec()), seed=3)
    tensors = {"prompt.ctx": torch.randn(3, 4)}
    tensors.update({f"regulator.ctx.{k}": v.detach().clone() for k, v in reg.state_dict().items()})
    old_spec = {"form": "residual", "input_norm": True, "beta_scale": "grad_rms", "init": "zero", "init_std": 0.01}
    meta = {
        "format_version": 1,
        "backbone": {
            "model_name": "GRAM-Test-Tiny",
            "weights": "",
            "text_width": 4,
            "vision_width": 4,
            "vision_layers": 1,
        },
        "prompt": {"n_ctx_text": 3, "n_ctx_vision": 0, "vision_depth": 0},
        "regulator": old_spec,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "provenance": {},
    }
    path = tmp_path / "old.safetensors"
    save_file(tensors, str(path), metadata={"gram": json.dumps(meta)})
    loaded = load_gram_init(path).regulator_modules()["ctx"]
    assert loaded.spec == RegulatorSpec()
    g = torch.randn(3, 4)
    torch.testing.assert_close(loaded(g), reg(g))


def test_test_time_regulation_copies_the_regulators_and_records_cos_and_norm_ratio():
    reg = _randomise(GradientRegulator(4, RegulatorSpec()), seed=4)
    regulation = GradientRegulation({"ctx": reg})
    p = torch.nn.Parameter(torch.zeros(3, 4))
    p.grad = torch.randn(3, 4) * 1e-3
    raw = p.grad.clone()
    regulation.apply_([("ctx", p)])
    with torch.no_grad():
        want = reg(raw)
    torch.testing.assert_close(p.grad, want)
    assert all(q.requires_grad for q in reg.parameters())  # the caller's φ stays trainable
    assert not any(q.requires_grad for q in regulation.parameters())
    summary = regulation.summary()
    assert summary["reg_norm_ratio"] == pytest.approx(float(want.norm() / raw.norm()), rel=1e-5)
    expected = torch.nn.functional.cosine_similarity(want.flatten(), raw.flatten(), dim=0)
    assert summary["reg_cos"] == pytest.approx(float(expected), abs=1e-6)


def test_finetune_and_score_mirrors_sgd_and_leaves_prompts_alone():
    prompts, batch, loss_fn = _toy(torch.float32)
    support, query = batch(8), batch(12)
    before = prompts.ctx.detach().clone()
    acc0 = finetune_and_score(prompts, None, loss_fn, support, query, steps=0, lr=0.1, momentum=0.9)
    with torch.no_grad():
        expected0 = float((loss_fn(prompts, query)[1].argmax(-1) == query["label"]).float().mean())
    assert acc0 == expected0
    finetune_and_score(prompts, None, loss_fn, support, query, steps=5, lr=0.5, momentum=0.9)
    assert torch.equal(prompts.ctx.detach(), before)
    # the same steps by hand
    module = PromptParams(ctx=before)
    opt = torch.optim.SGD([module.ctx], lr=0.5, momentum=0.9)
    for _ in range(5):
        opt.zero_grad()
        loss_fn(module, support)[0].backward()
        opt.step()
    assert not torch.equal(module.ctx.detach(), before)
    with torch.no_grad():
        hand = float((loss_fn(module, query)[1].argmax(-1) == query["label"]).float().mean())
    assert finetune_and_score(prompts, None, loss_fn, support, query, steps=5, lr=0.5, momentum=0.9) == hand
