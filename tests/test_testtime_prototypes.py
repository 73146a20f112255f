"""R_φ conditioned on CHC prototypes (meta/method/prototypes.py, ``META.TEST_TIME.PROTOTYPES``,
``--test-time-prototypes``): the prototypes against a hand computation, the conditioned regulator against its
formula, the meta-gradient along the context maps against float64 central differences, the init file round trip and
its checks, test-time tuning against an independent computation (the context folded into R_φ's biases), a
meta-training run that stores the prototypes, and the one-line refusals."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import assert_matches_central_differences
from helpers_metatrain import BASE, colour_hierarchy

from meta.finetune.init_io import InitMismatchError, export_gram_init, load_gram_init
from meta.finetune.regulated import GradientRegulation
from meta.finetune.testtime import TestTimeSpec, check_prototypes, image_generator, tune_one, view_batch
from meta.metatrain import build_cfg, main
from meta.metatrain.settings import read_train_settings
from meta.metatrain.testtime_objective import TestTimeObjective, view_features
from meta.metatrain.trainer import setup_run, train
from meta.method.gram import GRAMMetaLearner, MetaSpec
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.prototypes import Prototypes, prototypes_of
from meta.method.regulator import GradientRegulator, RegulatorSpec, conditioned

NAMES = ["cat", "dog", "tree"]
TESTTIME = ["META.MODE", "testtime", "META.TEST_TIME.VIEWS", "4", "META.TEST_TIME.CONFIDENT_SHARE", "0.5"]
COOP = ["META.PROMPT.N_CTX_TEXT", "4"]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _toy_hierarchy(seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(
        item_topic=np.array([0, 0, 0, 1, 1, 2, 2, -1]),
        item_domain=np.array([0, 1, 1, 0, -1, 3, 3, 0]),
        image_features=_unit(rng.normal(size=(8, 5))).astype(np.float32),
    )


def test_prototypes_are_unit_means_of_topics_and_domains_and_the_context_is_standardised():
    h = _toy_hierarchy()
    z = h.image_features.astype(np.float64)
    protos = prototypes_of(h)
    topics = _unit(np.stack([z[[0, 1, 2]].mean(0), z[[3, 4]].mean(0), z[[5, 6]].mean(0)]))
    domains = _unit(np.stack([z[[0]].mean(0), z[[1, 2]].mean(0), z[[3]].mean(0), z[[5, 6]].mean(0)]))  # (t, d) order
    np.testing.assert_allclose(protos.topics.numpy(), topics, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(protos.domains.numpy(), domains, rtol=1e-6, atol=1e-6)
    kept = z[:7]  # the pair outside every topic counts for nothing
    r = np.stack([(kept @ topics.T).max(1), (kept @ domains.T).max(1)], axis=1)
    np.testing.assert_allclose(protos.mean.numpy(), r.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(protos.std.numpy(), r.std(0), rtol=1e-5, atol=1e-6)
    s = protos.context(torch.from_numpy(kept).float())
    np.testing.assert_allclose(s.numpy(), (r - r.mean(0)) / r.std(0), rtol=1e-4, atol=1e-5)
    only = prototypes_of(h, topics=[1, 2])  # meta-training's topics only: topic 0 is not a prototype
    np.testing.assert_allclose(only.topics.numpy(), topics[1:], rtol=1e-6, atol=1e-6)
    assert only.domains.shape == (2, 5)
    with pytest.raises(ValueError, match="^META.TEST_TIME.PROTOTYPES: the task hierarchy has no pair"):
        prototypes_of(h, topics=[7])


def test_a_conditioned_regulator_starts_as_the_plain_one_and_follows_its_formula():
    torch.manual_seed(0)
    plain = GradientRegulator(6, RegulatorSpec(init="normal", init_std=0.3))
    cond = GradientRegulator(6, RegulatorSpec(init="normal", init_std=0.3, context=2))
    cond.load_state_dict({**plain.state_dict(), **{k: v for k, v in cond.state_dict().items() if "context" in k}})
    g = torch.randn(3, 6, dtype=torch.float64) * 1e-3
    plain, cond = plain.double(), cond.double()
    s = torch.tensor([0.7, -1.2], dtype=torch.float64)
    with conditioned([cond, None], s):
        torch.testing.assert_close(cond(g), plain(g))  # zero context maps: the unconditioned R_φ at any s
    with torch.no_grad():
        cond.gamma_context.weight.normal_(0.0, 0.5)
        cond.beta_context.weight.normal_(0.0, 0.5)
    rms = g.pow(2).mean().add(1e-12).sqrt()
    u = g / rms
    gamma = 1 + torch.tanh(u @ cond.gamma.weight.T + cond.gamma.bias + cond.gamma_context.weight @ s)
    beta = rms * torch.tanh(u @ cond.beta.weight.T + cond.beta.bias + cond.beta_context.weight @ s)
    with conditioned([cond], s):
        torch.testing.assert_close(cond(g), gamma * g + beta, rtol=1e-12, atol=1e-15)
        assert not torch.allclose(cond(g), plain(g))
    assert cond.context is None  # cleared after the block: s = 0, the plain R_φ again
    torch.testing.assert_close(cond(g), plain(g))
    assert RegulatorSpec(context=2).as_dict()["context"] == 2 and "context" not in RegulatorSpec().as_dict()
    with pytest.raises(ValueError, match="gate form takes no context"):
        RegulatorSpec(form="gate", context=2)


@pytest.fixture(scope="module")
def clip64(tiny_clip):
    return copy.deepcopy(tiny_clip[0]).double(), tiny_clip[1]


def _random_prototypes(embed: int, seed: int = 3) -> Prototypes:
    g = torch.Generator().manual_seed(seed)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, embed, generator=g), dim=1)  # noqa: E731
    return Prototypes(unit(3), unit(5), torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.25]))


def test_the_meta_gradient_along_the_context_maps_matches_central_differences_float64(clip64):
    clip, dims = clip64
    gen = torch.Generator().manual_seed(0)
    theta = PromptParams.from_spec(PromptSpec(n_ctx_text=2), clip, dims, generator=gen).double()
    ml = GRAMMetaLearner(theta, MetaSpec(inner_lr=0.5, regulator=RegulatorSpec(context=2))).double()
    with torch.no_grad():
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    pclip = PromptedCLIP(clip, dims, 2)
    images = torch.randn(2, 3, dims.image_size, dims.image_size, generator=gen, dtype=torch.float64)
    spec = TestTimeSpec(views=4, confident_share=0.5)
    views = view_features(pclip, torch.stack([view_batch(x, spec, gen) for x in images]))
    query = {"classnames": NAMES, "label": torch.tensor([1, 2]), "view_features": views}
    protos, loss_fn = _random_prototypes(dims.embed_dim), classification_loss(pclip)
    objective = TestTimeObjective(2, protos)
    ml.zero_grad(set_to_none=True)
    objective.backward(ml, loss_fn, None, query, n_tasks=1)
    context_maps = [p for n, p in ml.gbml.compute_update.named_parameters() if "context" in n]
    assert len(context_maps) == 2 and all(float(p.grad.abs().sum()) > 0 for p in context_maps)
    params = list(ml.prompt_module.parameters()) + list(ml.gbml.compute_update.parameters())
    analytic = [p.grad.detach().clone() for p in params]

    def value(obj=objective) -> float:
        return float(obj.backward(ml, loss_fn, None, query, 1, backward=lambda _: None)[1]["query_loss_after"])

    is_context = [any(p is q for q in context_maps) for p in params]
    masks = {"context maps": is_context, "all": [True] * len(params)}
    assert_matches_central_differences(value, params, analytic, masks, torch.Generator().manual_seed(4))
    assert value(TestTimeObjective(2)) != pytest.approx(value(), rel=1e-9)  # the context reaches the loss


def _conditioned_init(path, embed: int, protos: Prototypes, dims) -> tuple:
    torch.manual_seed(9)
    regs = {"ctx": GradientRegulator(dims.text_width, RegulatorSpec(init="normal", init_std=0.2, context=2))}
    with torch.no_grad():
        for name, p in regs["ctx"].named_parameters():
            if "context" in name:
                p.normal_(0.0, 0.5)
    theta = PromptParams(ctx=torch.randn(4, dims.text_width) * 0.02)
    return export_gram_init(path, theta, regs, dims, prototypes=protos.tensors()), theta, regs


def test_the_init_file_stores_the_prototypes_and_refuses_broken_ones(tmp_path, tiny_clip):
    _, dims = tiny_clip
    protos = _random_prototypes(dims.embed_dim)
    path, _, regs = _conditioned_init(tmp_path / "p.safetensors", dims.embed_dim, protos, dims)
    init = load_gram_init(path)
    back = init.prototypes()
    for name in ("topics", "domains", "mean", "std"):
        assert torch.equal(getattr(back, name), getattr(protos, name))
    (reg,) = init.regulator_modules().values()
    assert reg.spec.context == 2 and torch.equal(reg.gamma_context.weight, regs["ctx"].gamma_context.weight)
    zeros = PromptParams(ctx=torch.zeros(4, dims.text_width))
    plain = export_gram_init(tmp_path / "plain.safetensors", zeros, {}, dims)
    assert load_gram_init(plain).prototypes() is None
    broken = {**protos.tensors(), "prototypes.std": torch.tensor([0.3, 0.0])}
    bad = export_gram_init(tmp_path / "b.safetensors", zeros, {}, dims, prototypes=broken)
    with pytest.raises(InitMismatchError, match="tensor prototypes.std.*expected every value > 0"):
        load_gram_init(bad)
    partial = {k: v for k, v in protos.tensors().items() if not k.endswith("mean")}
    lacking = export_gram_init(tmp_path / "l.safetensors", zeros, {}, dims, prototypes=partial)
    with pytest.raises(InitMismatchError, match="prototypes.*lacks mean"):
        load_gram_init(lacking)


def test_test_time_tuning_reads_the_image_context_as_an_independent_bias_shift(tmp_path, tiny_clip):
    """With ``prototypes nearest``, R_φ's pre-activations gain U s(z) for the image's own frozen feature z: the same
    as a plain R_φ whose biases are b + U s(z), s(z) computed here with numpy."""
    clip, dims = tiny_clip
    protos = _random_prototypes(dims.embed_dim)
    path, _, _ = _conditioned_init(tmp_path / "p.safetensors", dims.embed_dim, protos, dims)
    init = load_gram_init(path)
    regulation = GradientRegulation(init.regulator_modules(), init.prototypes())
    theta, pclip = init.prompt_module(), PromptedCLIP(clip, dims, 4)
    image = torch.randn(3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(2))
    spec = TestTimeSpec(views=4, confident_share=0.5, steps=2, lr=0.05, prototypes="nearest")
    tuned, _, _ = tune_one(pclip, theta, image, NAMES, spec, image_generator(1, 0), regulation)
    with torch.no_grad():
        z = pclip.image_features(None, image[None]).double().numpy()[0]
    r = np.array([(protos.topics.double().numpy() @ z).max(), (protos.domains.double().numpy() @ z).max()])
    s = torch.from_numpy((r - protos.mean.double().numpy()) / protos.std.double().numpy()).float()
    (reg,) = init.regulator_modules().values()
    shifted = GradientRegulator(dims.text_width, RegulatorSpec(init="normal", init_std=0.2))
    with torch.no_grad():
        state = {k: v for k, v in reg.state_dict().items() if "context" not in k}
        state["gamma.bias"] = state["gamma.bias"] + reg.gamma_context.weight @ s
        state["beta.bias"] = state["beta.bias"] + reg.beta_context.weight @ s
    shifted.load_state_dict(state)
    plain_spec = TestTimeSpec(views=4, confident_share=0.5, steps=2, lr=0.05)
    expected, _, _ = tune_one(pclip, theta, image, NAMES, plain_spec, image_generator(1, 0),
                              GradientRegulation({"ctx": shifted}))  # fmt: skip
    torch.testing.assert_close(tuned, expected, rtol=1e-5, atol=1e-6)
    unconditioned, _, _ = tune_one(pclip, theta, image, NAMES, plain_spec, image_generator(1, 0), regulation)
    assert (unconditioned - tuned).abs().max() > 1e-5  # the context moved the prediction: not a no-op comparison


def test_prototypes_asked_of_a_start_without_them_end_in_one_line_naming_the_key(tmp_path, tiny_clip):
    _, dims = tiny_clip
    spec = TestTimeSpec(prototypes="nearest")
    plain = GradientRegulation({"ctx": GradientRegulator(dims.text_width)})
    unconditioned = GradientRegulation({"ctx": GradientRegulator(dims.text_width)}, _random_prototypes(dims.embed_dim))
    for regulation, wanted in (
        (None, "needs R_φ from a GRAM init file"),
        (plain, "the init file holds no CHC prototypes"),
        (unconditioned, "the init file's R_φ was not meta-trained on its prototypes"),
    ):
        with pytest.raises(ValueError, match=f"^--test-time-prototypes nearest: {wanted}") as err:
            check_prototypes(spec, regulation, "--test-time-prototypes")
        assert "\n" not in str(err.value)
    check_prototypes(TestTimeSpec(), None, "--test-time-prototypes")  # none asks for nothing
    with pytest.raises(ValueError, match="prototypes: expected none | nearest"):
        TestTimeSpec(prototypes="far")


@pytest.mark.slow
def test_meta_training_with_prototypes_stores_them_and_trains_the_context_maps(tmp_path):
    h = colour_hierarchy()
    opts = BASE + TESTTIME + COOP + ["META.TEST_TIME.PROTOTYPES", "nearest"]
    run = setup_run(read_train_settings(build_cfg(opts=opts, output_dir=str(tmp_path / "probe"))), hierarchy=h)
    want = prototypes_of(h, run.train_topics)
    assert run.learner.objective.prototypes is not None
    assert torch.equal(run.learner.objective.prototypes.topics, want.topics)
    result = train(build_cfg(opts=opts, output_dir=str(tmp_path / "run")), hierarchy=h, echo=lambda m: None)
    init = load_gram_init(result["export"]["init"])
    stored = init.prototypes()
    assert stored is not None and all(torch.equal(getattr(stored, n), getattr(want, n)) for n in ("topics", "domains"))
    (reg,) = init.regulator_modules().values()
    assert (
        reg.spec.context == 2 and float(reg.gamma_context.weight.detach().abs().sum()) > 0
    )  # trained from its zero start
    assert init.metadata["regulator"]["context"] == 2


def test_bad_prototype_settings_are_one_line_errors_naming_the_key(tmp_path, capsys):
    out = tmp_path / "r"
    for extra, start in (
        (TESTTIME + ["META.TEST_TIME.PROTOTYPES", "far"], "error: META.TEST_TIME.PROTOTYPES: expected none | nearest"),
        (["META.TEST_TIME.PROTOTYPES", "nearest"], "error: META.TEST_TIME.PROTOTYPES: expected none unless META.MODE"),
        (
            TESTTIME + ["META.TEST_TIME.PROTOTYPES", "nearest", "META.REGULATE", "False"],
            "error: META.TEST_TIME.PROTOTYPES: expected none unless",
        ),
    ):
        assert main(["train", "--output-dir", str(out), *BASE, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
    assert not out.exists()
