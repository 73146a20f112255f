"""CoCoOp's prompt learner (``meta.method.cocoop``, key ``cocoop``; Zhou et al. CVPR 2022, KaiyangZhou/CoOp
``trainers/cocoop.py``): its start is CoCoOp's (words or N(0, 0.02²), ``nn.Linear``'s rule for the meta-net), its
logits are CoCoOp's forward written with ``torch.nn`` modules loaded under CoCoOp's state-dict names, its
second-order meta-gradient matches float64 finite differences, the stacked task loop agrees with the sequential one,
``python -m meta train`` meta-trains it and the export writes a checkpoint stock CoCoOp's layout reads, and the
table's ``GRAM_CoCoOp`` Dassl trainer trains it."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meta.method import cocoop
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.learners import learner_of
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.model.text_encoder import ClassTokenCache, context_from_words, encode_text_with_context

NAMES = ["apple", "boat", "red cat"]
OTHER = ["drum", "long thin eel", "fig"]


def _theta(clip, dims, seed: int = 1, **spec) -> PromptParams:
    spec = PromptSpec(**{"n_ctx_text": 4, "learner": cocoop.KEY, **spec})
    return PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(seed))


def stock_meta_net(theta) -> nn.Sequential:
    """CoCoOp's meta-net as its authors build it, loaded (strictly) from θ under CoCoOp's state-dict names."""
    w1 = theta.meta_net_linear1_weight
    net = nn.Sequential(
        OrderedDict(
            [
                ("linear1", nn.Linear(w1.shape[1], w1.shape[0])),
                ("relu", nn.ReLU()),
                ("linear2", nn.Linear(w1.shape[0], theta.ctx.shape[1])),
            ]
        )
    ).to(w1.dtype)
    state = {cocoop.STOCK_NAMES[n][len("meta_net.") :]: p.detach() for n, p in theta.named_parameters() if n != "ctx"}
    net.load_state_dict(state, strict=True)
    return net


def stock_logits(clip, scale: float, theta, names, image: torch.Tensor) -> torch.Tensor:
    """CoCoOp's ``CustomCLIP.forward`` on normalised image features ``[n, E]``: bias = meta_net(f) added to every
    context vector, each image's prompts through the text tower, ``scale · f · t``; ``[n, C]``."""
    tokens = ClassTokenCache(clip, theta.ctx.shape[0], template="{}.").tokens(names)
    bias = stock_meta_net(theta)(image)  # [n, d_t]
    rows = []
    for f, b in zip(image, bias):
        text = F.normalize(encode_text_with_context(clip, tokens, theta.ctx.detach() + b.unsqueeze(0)), dim=-1)
        rows.append(scale * f @ text.t())
    return torch.stack(rows)


def test_the_start_is_cocoops(tiny_clip):
    clip, dims = tiny_clip
    hidden = dims.embed_dim // 16
    theta = _theta(clip, dims)
    assert [n for n, _ in theta.named_parameters()] == list(cocoop.TENSORS)
    assert {n: tuple(p.shape) for n, p in theta.named_parameters()} == {
        "ctx": (4, dims.text_width),
        "meta_net_linear1_weight": (hidden, dims.embed_dim),
        "meta_net_linear1_bias": (hidden,),
        "meta_net_linear2_weight": (dims.text_width, hidden),
        "meta_net_linear2_bias": (dims.text_width,),
    }
    assert theta.structure() == {
        "n_ctx_text": 4,
        "n_ctx_vision": 0,
        "vision_depth": 0,
        "text_depth": 1,
        "coupling": "none",
        "meta_input": dims.embed_dim,
        "meta_hidden": hidden,
        "learner": cocoop.KEY,
    }
    # the caller's generator: ctx ~ N(0, 0.02²) first, then nn.Linear's reset_parameters rule for both layers
    gen = torch.Generator().manual_seed(1)
    torch.testing.assert_close(theta.ctx.detach(), torch.randn(4, dims.text_width, generator=gen) * 0.02)
    for layer, (d_in, d_out) in (("linear1", (dims.embed_dim, hidden)), ("linear2", (hidden, dims.text_width))):
        weight, bias = torch.empty(d_out, d_in), torch.empty(d_out)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
        nn.init.uniform_(bias, -1 / math.sqrt(d_in), 1 / math.sqrt(d_in), generator=gen)
        torch.testing.assert_close(getattr(theta, f"meta_net_{layer}_weight").detach(), weight)
        torch.testing.assert_close(getattr(theta, f"meta_net_{layer}_bias").detach(), bias)
    # CTX_INIT "a photo of a": the words' token embeddings, the meta-net drawn as before
    words = _theta(clip, dims, ctx_init="a photo of a")
    torch.testing.assert_close(words.ctx.detach(), context_from_words(clip, "a photo of a").float())
    assert not torch.equal(words.meta_net_linear1_weight, theta.meta_net_linear1_weight)  # ctx drew nothing there
    tensors = {n: p.detach() for n, p in theta.named_parameters()}
    with pytest.raises(ValueError, match="missing meta_net_linear2_bias"):
        PromptParams(cocoop.KEY, **{**tensors, "meta_net_linear2_bias": None})
    with pytest.raises(ValueError, match="do not chain with ctx"):
        PromptParams(cocoop.KEY, **{**tensors, "meta_net_linear2_weight": torch.zeros(dims.text_width, hidden + 1)})
    with pytest.raises(ValueError, match="embedding width >= 16"):
        cocoop.meta_hidden(8)


def test_logits_are_cocoops_forward(tiny_clip):
    clip, dims = tiny_clip
    theta = _theta(clip, dims)
    with torch.no_grad():  # a bias of the context's size, so the meta-net matters
        theta.meta_net_linear2_weight.mul_(20.0)
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    images = torch.randn(4, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        image, text = pclip.features(theta, NAMES, images=images)
        want = stock_logits(clip, pclip.logit_scale, theta, NAMES, F.normalize(clip.encode_image(images), dim=-1))
        got = pclip.logits(theta, NAMES, images=images)
        cached = pclip.logits(theta, NAMES, image_features=image)
    assert tuple(text.shape) == (4, len(NAMES), dims.embed_dim) and learner_of(theta).per_image_text
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached, got)
    assert (text[0] - text[1]).abs().max() > 1e-3  # each image has its own text side
    # the task stack: task b of one pass is the one-task forward of task b
    stack = PromptParams(cocoop.KEY, **{n: p.detach() for n, p in theta.named_parameters()})
    stacked = type("Stack", (), {})()
    stacked.learner = cocoop.KEY
    for n, p in stack.named_parameters():
        setattr(stacked, n, torch.stack([p.detach(), p.detach() * 0.5]))
    half = PromptParams(cocoop.KEY, **{n: p.detach() * 0.5 for n, p in theta.named_parameters()})
    with torch.no_grad():
        img2, text2 = learner_of(theta).stacked_features(pclip, stacked, [NAMES, OTHER], images=torch.cat([images] * 2))
        other = pclip.features(half, OTHER, images=images)[1]
    assert tuple(text2.shape) == (2, 4, len(NAMES), dims.embed_dim)
    torch.testing.assert_close(text2[0], text, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(text2[1], other, rtol=1e-5, atol=1e-6)


def _tasks(dims, n_tasks: int, features: bool, dtype=torch.float32) -> list[TaskBatch]:
    gen = torch.Generator().manual_seed(3)

    def part(names, shots: int) -> dict:
        n = len(names) * shots
        batch = {"classnames": names, "label": torch.randperm(n, generator=gen) % len(names)}
        if features:
            batch["features"] = F.normalize(torch.randn(n, dims.embed_dim, generator=gen), dim=-1).to(dtype)
        else:
            batch["images"] = torch.randn(n, 3, dims.image_size, dims.image_size, generator=gen).to(dtype)
        return batch

    return [TaskBatch(part([NAMES, OTHER][b % 2], 1), part([NAMES, OTHER][b % 2], 2)) for b in range(n_tasks)]


def _learner(theta, loop: str, dtype=torch.float32) -> GRAMMetaLearner:
    torch.manual_seed(4)  # R_φ's normal start draws from the global RNG: the same φ for every learner built here
    spec = MetaSpec(inner_lr=0.5, task_batching=loop)
    spec.regulator.init, spec.regulator.init_std = "normal", 0.2
    return GRAMMetaLearner(copy.deepcopy(theta), spec).to(dtype)


def test_meta_net_meta_gradient_matches_float64_finite_differences(tiny_clip):
    """The second-order meta-gradient ∇_θ (1/B) Σ_b L_q(θ − α R_φ(∇L_s(θ))) of every meta-net tensor (and ctx),
    against central differences of the same objective in float64 along a random direction."""
    clip, dims = tiny_clip
    clip64 = copy.deepcopy(clip).double()
    theta = _theta(clip, dims).double()
    with torch.no_grad():
        theta.meta_net_linear2_weight.mul_(20.0)
    tasks = _tasks(dims, 2, features=True, dtype=torch.float64)
    loss_fn = classification_loss(PromptedCLIP(clip64, dims, 4))
    ml = _learner(theta, "off", torch.float64)
    ml.accumulate(tasks, loss_fn)
    grads = {n: p.grad.clone() for n, p in ml.prompt_module.named_parameters()}

    def objective(name: str, shift: torch.Tensor) -> float:
        probe = _learner(theta, "off", torch.float64)
        with torch.no_grad():
            getattr(probe.prompt_module, name).add_(shift)
        # the objective accumulate differentiates: the query loss after the regulated inner step, task mean
        return sum(
            float(loss_fn(probe.unroll(loss_fn, t.support)[0].module, t.query)[0].detach()) for t in tasks
        ) / len(tasks)

    eps = 1e-5
    for name in cocoop.TENSORS:
        direction = torch.randn(grads[name].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        numeric = (objective(name, eps * direction) - objective(name, -eps * direction)) / (2 * eps)
        analytic = float((grads[name] * direction).sum())
        assert abs(analytic) > 1e-6, name
        assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-9), name


@pytest.mark.parametrize("features", [True, False], ids=["cached_features", "images"])
def test_stacked_task_loop_agrees_with_the_sequential_one(tiny_clip, features):
    clip, dims = tiny_clip
    theta = _theta(clip, dims)
    with torch.no_grad():
        theta.meta_net_linear2_weight.mul_(20.0)
    tasks = _tasks(dims, 3, features=features)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, 4))
    out = {}
    for loop in ("off", "on"):
        ml = _learner(theta, loop)
        if loop == "on":
            assert ml.task_batching.accumulate(ml, tasks, loss_fn) is not None  # the stacked pass ran
        else:
            ml.accumulate(tasks, loss_fn)
        out[loop] = {n: p.grad.clone() for n, p in ml.named_parameters() if p.grad is not None}
    assert sorted(out["on"]) == sorted(out["off"]) and len(out["off"]) == 5 + 5 * 4  # θ: 5, R_φ: 4 per tensor
    for name, g in out["off"].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(out["on"][name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))


def test_meta_training_and_the_export_for_stock_cocoop(tmp_path):
    """``configs/meta/train_cocoop.yaml``'s learner meta-trains (``python -m meta train``'s path); the export writes the
    init file and, beside it, ``cocoop_nctx4/prompt_learner/model.pth.tar-0`` whose state dict loads strictly into
    CoCoOp's own meta-net and holds θ*; the checkpoint of the run rebuilds the same θ*."""
    from helpers_metatrain import BASE, colour_hierarchy

    from meta.config import load_meta_cfg
    from meta.finetune.init_io import load_gram_init
    from meta.metatrain import build_cfg, settings
    from meta.metatrain.checkpoint import CHECKPOINT_NAME, load_checkpoint
    from meta.metatrain.export import export_run, verify_exports
    from meta.metatrain.trainer import train

    assert settings.prompt_spec(load_meta_cfg("configs/meta/train_cocoop.yaml", [])).learner == cocoop.KEY
    run = tmp_path / "run"
    cfg = build_cfg(opts=BASE + ["META.STEPS", "2", "META.PROMPT.LEARNER", cocoop.KEY], output_dir=str(run))
    result = train(cfg, hierarchy=colour_hierarchy(), echo=lambda _msg: None)
    init = load_gram_init(result["export"]["init"])
    assert init.metadata["prompt"]["learner"] == cocoop.KEY and sorted(init.prompt) == sorted(cocoop.TENSORS)
    assert sorted(init.regulators) == sorted(cocoop.TENSORS)  # one R_φ per tensor, the meta-net's included
    state = load_checkpoint(run / CHECKPOINT_NAME)
    start = load_checkpoint(run / CHECKPOINT_NAME)["learner"]["gbml"]
    file = run / "cocoop_nctx4" / "prompt_learner" / "model.pth.tar-0"
    assert result["export"]["cocoop"] == run / "cocoop_nctx4" and file.is_file()
    saved = torch.load(str(file), map_location="cpu", weights_only=True)
    assert saved["epoch"] == 0 and sorted(saved["state_dict"]) == sorted(cocoop.STOCK_NAMES.values())
    theta = PromptParams(cocoop.KEY, **init.prompt)
    net = stock_meta_net(theta)
    net.load_state_dict({k[len("meta_net.") :]: v for k, v in saved["state_dict"].items() if k != "ctx"}, strict=True)
    for name, stock in cocoop.STOCK_NAMES.items():
        assert torch.equal(saved["state_dict"][stock], init.prompt[name]), name
        assert torch.equal(start[f"module.{name}"].float(), init.prompt[name]), name
    assert verify_exports(state, run) == []
    file.unlink()  # a missing stock checkpoint is a problem the resume rewrites
    assert any("cocoop_nctx4" in p for p in verify_exports(state, run))
    paths = export_run(run)
    assert file.is_file() and verify_exports(state, run) == [] and "--load-epoch 0" in paths["coop_usage"]


@pytest.mark.dassl
def test_the_table_trainer_gram_cocoop_trains_the_learner(tmp_path, tiny_clip):
    """The generated ``GRAM_CoCoOp`` is in Dassl's registry; its baseline config (CTX_INIT "a photo of a") builds θ of
    the ``cocoop`` learner from the words, one epoch moves every tensor, and its test logits are the learner's."""
    pytest.importorskip("dassl", reason="Dassl not installed: this test runs the Dassl trainer")
    from dassl.engine import TRAINER_REGISTRY
    from helpers_dassl import dassl_run, write_dtd

    import trainers  # noqa: F401  (registers the GRAM trainers)

    assert TRAINER_REGISTRY.get("GRAM_CoCoOp").gram_trainer
    clip, dims = tiny_clip
    write_dtd(tmp_path / "data")
    torch.save(clip.state_dict(), tmp_path / "tiny_clip.pt")
    trainer, _ = dassl_run(tmp_path, "cocoop", [], "base", tmp_path / "out")
    theta = trainer.model.prompt_learner
    assert theta.learner == cocoop.KEY and [n for n, _ in theta.named_parameters()] == list(cocoop.TENSORS)
    torch.testing.assert_close(theta.ctx.detach().float(), context_from_words(clip, "a photo of a").float())
    before = {n: p.detach().clone() for n, p in theta.named_parameters()}
    trainer.train()
    for name, p in theta.named_parameters():
        assert (p.detach() - before[name]).abs().max() > 1e-6, name
    pclip = PromptedCLIP(clip, dims, 4)
    batch = next(iter(trainer.test_loader))
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.model_inference(batch["img"]), pclip.logits(theta, trainer.model.classnames, images=batch["img"])
        )
