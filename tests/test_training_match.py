"""The switches that make GRAM's test-time use match its meta-training, each against an independent
computation: the regulation window (R_φ of the window's mean gradient, one step), the launch step
(θ − α R_φ(mean gradient)), the before-adaptation query term of the outer objective, the component
rows' starts (θ* only, R_φ only) and the Dassl keys that reach them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from meta.evaluation import MethodSpec, TrainSpec
from meta.evaluation.training import LabelledSet, PromptTuner, StartPoint, build_prompts
from meta.finetune.engine import StartSpec, build_start
from meta.finetune.init_io import export_gram_init
from meta.finetune.regulated import GradientRegulation, LaunchStep, UpdateWindow, launch_
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.regulator import GradientRegulator, RegulatorSpec

NAMES = ["circle", "square", "triangle"]


def _regulator(dim: int, seed: int = 0) -> GradientRegulator:
    """A non-identity R_φ (the zero init would hide a wrong mean/sum)."""
    reg = GradientRegulator(dim, RegulatorSpec())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in reg.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return reg


def test_windowed_regulation_is_r_phi_of_the_window_mean_times_its_size():
    reg = _regulator(6)
    regulation = GradientRegulation({"ctx": reg})
    grads = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(1))  # 5 per-image gradients [M, d]
    p = torch.nn.Parameter(torch.zeros(3, 6))
    p.grad = grads.sum(0).clone()  # what 5 backward passes leave in p.grad
    regulation.apply_([("ctx", p)], count=5)
    expected = 5 * reg(grads.mean(0))
    torch.testing.assert_close(p.grad, expected.detach())
    # count 1 is the per-image rule, and R_φ is not linear: the window differs from summing R_φ(g_i)
    per_image = sum(reg(g) for g in grads).detach()
    assert (per_image - expected).norm() > 1e-3 * expected.norm()
    with pytest.raises(ValueError, match="count must be >= 1"):
        regulation.apply_([("ctx", p)], count=0)


def test_update_window_closes_after_size_passes_and_at_the_epoch_end():
    window = UpdateWindow(3)
    assert [window.push(last=i == 6) for i in range(7)] == [0, 0, 3, 0, 0, 3, 1]
    assert [UpdateWindow(1).push() for _ in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="regulation window must be >= 1"):
        UpdateWindow(0)


def _features_set(dims, n: int, seed: int) -> LabelledSet:
    gen = torch.Generator().manual_seed(seed)
    feats = F.normalize(torch.randn(n, 1, dims.embed_dim, generator=gen), dim=-1)
    return LabelledSet(
        impaths=[f"x{i}" for i in range(n)], labels=torch.arange(n) % len(NAMES), classnames=NAMES, features=feats
    )


def test_prompt_tuner_window_takes_one_regulated_step_per_window(tiny_clip):
    """One epoch at a constant lr, no momentum / decay, batch 1, window 4 over 8 images: two steps, each
    θ <- θ − lr · 4 · R_φ(mean of the window's 4 per-image gradients at the current θ)."""
    clip, dims = tiny_clip
    pclip = PromptedCLIP(clip, dims, 4)
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=4), clip, dims, generator=torch.Generator().manual_seed(0))
    regulation = GradientRegulation({"ctx": _regulator(dims.text_width)})
    spec = TrainSpec(
        epochs=1,
        batch_size=1,
        lr=0.05,
        momentum=0.0,
        weight_decay=0.0,
        scheduler="constant",
        warmup_epochs=0,
        augment="none",
        eval_every_epoch=False,
    )
    data = _features_set(dims, 8, seed=3)
    start = copy.deepcopy(prompts)
    tuner = PromptTuner(pclip, prompts, regulation, spec, seed=7, train_images=None, test_images=None, reg_window=4)
    tuner.fit(data)

    gen = torch.Generator().manual_seed(7)  # the tuner's stream: view offsets first, then the order
    torch.randint(1, (8,), generator=gen)
    order = torch.randperm(8, generator=gen)
    loss_fn = classification_loss(pclip)
    theta = start.ctx.detach().clone()
    for window in order.split(4):
        grads = []
        for i in window.tolist():
            view = PromptParams(ctx=theta.clone().requires_grad_(True))
            loss, _ = loss_fn(
                view, {"classnames": NAMES, "label": data.labels[i : i + 1], "features": data.features[i : i + 1, 0]}
            )
            grads.append(torch.autograd.grad(loss, view.ctx)[0])
        mean = torch.stack(grads).mean(0)
        theta = theta - 0.05 * 4 * regulation.regulators["ctx"](mean).detach()
    torch.testing.assert_close(prompts.ctx.detach(), theta, rtol=1e-5, atol=1e-6)


def test_launch_is_the_meta_trained_inner_step_on_the_mean_gradient(tiny_clip):
    clip, dims = tiny_clip
    pclip = PromptedCLIP(clip, dims, 2)
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=2), clip, dims, generator=torch.Generator().manual_seed(2))
    reg = _regulator(dims.text_width, seed=4)
    data = _features_set(dims, 6, seed=5)
    loss_fn = classification_loss(pclip)
    batch = {"classnames": NAMES, "label": data.labels, "features": data.features[:, 0]}

    def grad_at(ctx: torch.Tensor) -> torch.Tensor:
        view = PromptParams(ctx=ctx.detach().clone())
        return torch.autograd.grad(loss_fn(view, batch)[0], view.ctx)[0]

    theta = prompts.ctx.detach().clone()
    g = grad_at(theta)
    v1 = reg(g).detach()
    theta1 = theta - 0.3 * v1  # step 1
    g1 = grad_at(theta1)
    expected = theta1 - 0.3 * (0.5 * v1 + reg(g1).detach())  # step 2, heavy ball μ = 0.5

    spec = TrainSpec(test_batch_size=4)  # two chunks: the mean gradient is assembled from parts
    tuner = PromptTuner(
        pclip,
        prompts,
        GradientRegulation({"ctx": reg}),
        spec,
        seed=1,
        train_images=None,
        test_images=None,
        launch_step=LaunchStep(alpha=0.3, steps=2, momentum=0.5),
    )
    before = tuner.launch(data)
    torch.testing.assert_close(prompts.ctx.detach(), expected, rtol=1e-4, atol=3e-5)
    assert before == pytest.approx(float(loss_fn(PromptParams(ctx=theta.detach()), batch)[0]), rel=1e-5)
    # raw launch (θ* only rows): no regulator
    raw = PromptParams(ctx=theta.detach().clone())
    launch_(raw, None, lambda p: loss_fn(p, batch)[0], LaunchStep(alpha=0.3))
    torch.testing.assert_close(raw.ctx.detach(), theta.detach() - 0.3 * g)


def test_launch_step_reads_the_inner_loop_from_the_init_metadata():
    meta = {"provenance": {"meta": {"inner_lr": 0.1, "inner_steps": 2, "inner_momentum": 0.9}}}
    assert LaunchStep.from_metadata(meta) == LaunchStep(0.1, 2, 0.9)
    with pytest.raises(ValueError, match="f.safetensors: provenance.meta.inner_lr is missing"):
        LaunchStep.from_metadata({"provenance": {}}, source="f.safetensors")


def test_query_before_weight_adds_the_query_loss_at_theta(tiny_clip):
    """Outer gradient with w > 0 = gradient with w = 0 plus w ∇θ L_q(θ) (φ's gradient unchanged)."""
    clip, dims = tiny_clip
    spec = PromptSpec(n_ctx_text=2)
    pclip = PromptedCLIP(clip, dims, 2)
    gen = torch.Generator().manual_seed(1)

    def batch(n):
        return {
            "classnames": NAMES,
            "label": torch.arange(3).repeat(n),
            "features": F.normalize(torch.randn(3 * n, dims.embed_dim, generator=gen), dim=-1),
        }

    task = TaskBatch(batch(1), batch(2))
    loss_fn = classification_loss(pclip)
    grads = {}
    for w in (0.0, 0.7):
        prompts = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(0))
        ml = GRAMMetaLearner(prompts, MetaSpec(inner_lr=0.5, query_before_weight=w))
        with torch.no_grad():
            for p in ml.gbml.compute_update.parameters():
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
        ml.accumulate([task], loss_fn)
        grads[w] = {n: p.grad.clone() for n, p in ml.named_parameters() if p.grad is not None}
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(0))
    extra = torch.autograd.grad(loss_fn(theta, task.query)[0], theta.ctx)[0]
    ctx_key = next(k for k in grads[0.0] if k.endswith("ctx"))
    torch.testing.assert_close(grads[0.7][ctx_key], grads[0.0][ctx_key] + 0.7 * extra, rtol=1e-4, atol=2e-6)
    for key in grads[0.0]:
        if key != ctx_key:
            torch.testing.assert_close(grads[0.7][key], grads[0.0][key])
    with pytest.raises(ValueError, match="query_before_weight must be >= 0"):
        MetaSpec(query_before_weight=-1.0)


def test_component_starts_theta_star_only_and_r_phi_only(tiny_clip, tmp_path):
    clip, dims = tiny_clip
    star = PromptParams(ctx=torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(9)))
    reg = _regulator(dims.text_width, seed=1)
    path = tmp_path / "init.safetensors"
    export_gram_init(
        path,
        star,
        {"ctx": reg},
        dims,
        provenance={
            "meta": {"inner_lr": 0.1, "inner_steps": 1, "inner_momentum": 0.0},
            "tasks": {"k_way": 5, "n_support": 4},
        },
    )
    scratch, _, info_b = build_prompts(MethodSpec("CoOp", n_ctx_text=4), clip, dims, seed=3)
    assert "launch" not in info_b and "reg_window" not in info_b  # the defaults touch only GRAM starts

    init_only, reg0, info0 = build_prompts(MethodSpec("a", init_path=str(path), regulate=False), clip, dims, seed=3)
    assert reg0 is None and info0["source"] == "gram_file"
    torch.testing.assert_close(init_only.ctx.detach(), star.ctx)

    reg_only, reg1, info1 = build_prompts(
        MethodSpec("b", init_path=str(path), regulate=True, init_prompts=False, launch=True), clip, dims, seed=3
    )
    assert info1["source"] == "scratch" and info1["launch"] == {"alpha": 0.1, "steps": 1, "momentum": 0.0}
    torch.testing.assert_close(reg_only.ctx.detach(), scratch.ctx.detach())  # the baseline's very start
    g = torch.randn(4, dims.text_width)
    torch.testing.assert_close(reg1.regulators["ctx"](g), reg(g))
    # in memory (meta-validation): the same two starts
    point = StartPoint(star, {"ctx": reg}, launch=LaunchStep(0.1), support_size=20)
    p2, _, _ = build_prompts(MethodSpec("c", regulate=True, init_prompts=False), clip, dims, seed=3, start=point)
    torch.testing.assert_close(p2.ctx.detach(), scratch.ctx.detach())
    with pytest.raises(ValueError, match="neither θ\\* \\(init_prompts\\) nor R_φ"):
        MethodSpec("d", init_path=str(path), regulate=False, init_prompts=False)
    with pytest.raises(ValueError, match="launch=True needs α"):
        build_prompts(MethodSpec("e", launch=True), clip, dims, seed=3)


def test_downstream_validation_is_the_evaluators_fine_tuning_on_the_support(tiny_clip):
    """META.VAL_PROTOCOL downstream: the same numbers as PromptTuner fine-tuning the support (features,
    batch 1, CoCoOp's schedule) and scoring the query; images get seeded crops that stay in range."""
    from meta.metatrain.downstream_val import crop_and_flip, downstream_accuracy

    clip, dims = tiny_clip
    pclip = PromptedCLIP(clip, dims, 2)
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=2), clip, dims, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(4)

    def mk(n):
        return {
            "classnames": NAMES,
            "label": torch.arange(3).repeat(n),
            "features": F.normalize(torch.randn(3 * n, dims.embed_dim, generator=gen), dim=-1),
        }

    support, query = mk(2), mk(3)
    spec = TrainSpec(epochs=3, batch_size=1, augment="none", aug_views=1, eval_every_epoch=False)
    reg = _regulator(dims.text_width, seed=2)
    start = build_start(
        StartSpec(prompt=PromptSpec(n_ctx_text=2), regulate=True, reg_window=2),
        clip,
        dims,
        point=StartPoint(prompts, {"ctx": reg}, support_size=6),
    )
    acc = downstream_accuracy(pclip, start, support, query, spec, seed=5)

    theta = copy.deepcopy(prompts)
    tuner = PromptTuner(pclip, theta, GradientRegulation({"ctx": reg}), spec, 5, None, None, reg_window=2)
    tuner.fit(LabelledSet([f"s{i}" for i in range(6)], support["label"], NAMES, support["features"].unsqueeze(1)))
    expected = tuner.accuracy(LabelledSet([f"q{i}" for i in range(9)], query["label"], NAMES, query["features"]))
    assert acc == pytest.approx(expected)
    assert torch.equal(theta.ctx, theta.ctx) and not torch.equal(theta.ctx.detach(), prompts.ctx.detach())
    # the caller's θ is untouched
    fresh = PromptParams.from_spec(PromptSpec(n_ctx_text=2), clip, dims, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(prompts.ctx.detach(), fresh.ctx.detach())

    image = torch.randn(3, 16, 16)
    a = crop_and_flip(image, (0.5, 1.0), torch.Generator().manual_seed(1))
    b = crop_and_flip(image, (0.5, 1.0), torch.Generator().manual_seed(1))
    assert a.shape == image.shape and torch.equal(a, b)
    assert torch.equal(
        crop_and_flip(image, (1.0, 1.0), torch.Generator().manual_seed(3)).abs().sum(),
        crop_and_flip(image, (1.0, 1.0), torch.Generator().manual_seed(3)).abs().sum(),
    )


def test_window_zero_is_the_meta_training_support_size(tiny_clip, tmp_path):
    """reg_window 0 resolves to k_way × n_support of the init file's tasks (evaluator, start point, Dassl key)."""
    from meta.finetune.regulated import resolve_window, support_size

    clip, dims = tiny_clip
    star = PromptParams(ctx=torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(2)))
    reg = _regulator(dims.text_width, seed=4)
    path = tmp_path / "init.safetensors"
    export_gram_init(
        path, star, {"ctx": reg}, dims, provenance={"tasks": {"k_way": 5, "n_support": 4}, "meta": {"inner_lr": 0.1}}
    )
    assert support_size({"provenance": {"tasks": {"k_way": 3, "n_support": 7}}}) == 21
    assert resolve_window(6, None) == 6
    with pytest.raises(ValueError, match="old.safetensors: provenance.tasks.k_way / n_support are missing"):
        resolve_window(0, {"provenance": {}}, source="old.safetensors")
    with pytest.raises(ValueError, match="must be >= 0"):
        resolve_window(-1, None)

    _, _, info = build_prompts(MethodSpec("w0", init_path=str(path), regulate=True, reg_window=0), clip, dims, 1)
    assert info["reg_window"] == 20
    _, _, info = build_prompts(MethodSpec("w3", init_path=str(path), regulate=True, reg_window=3), clip, dims, 1)
    assert info["reg_window"] == 3
    _, reg_none, info = build_prompts(
        MethodSpec("raw", init_path=str(path), regulate=False, reg_window=0), clip, dims, 1
    )
    assert reg_none is None and "reg_window" not in info
    point = StartPoint(star, {"ctx": reg}, support_size=12)
    _, _, info = build_prompts(MethodSpec("m", regulate=True, reg_window=0), clip, dims, 1, start=point)
    assert info["reg_window"] == 12
    with pytest.raises(ValueError, match="needs StartPoint.support_size"):
        build_prompts(MethodSpec("m", regulate=True, reg_window=0), clip, dims, 1, start=StartPoint(star, {"ctx": reg}))
    with pytest.raises(ValueError, match="reg_window must be >= 0"):
        MethodSpec("bad", init_path=str(path), regulate=True, reg_window=-2)
