"""A learner whose text prompts depend on each image is one class: CoCoOp's meta-net (Zhou et al., CVPR 2022,
"Conditional Prompt Learning for Vision-Language Models"; KaiyangZhou/CoOp ``trainers/cocoop.py``) as a toy,

    ctx_i = ctx + π(f_i),   π(f) = W₂ relu(W₁ f + b₁) + b₂,   logit_ik = s · f_i · w_k(ctx_i)

with f_i the normalised frozen image feature and w_k(ctx_i) class k's text feature under image i's context.  θ holds
``ctx`` and the meta-net's weights (tensors that are not prompt tokens); the learner overrides the forward of
:class:`meta.method.learners.PromptLearner` (``features`` / ``stacked_features``) and returns text per image
``[n, C, E]``.  The tests check its logits against a hand computation, its second-order meta-gradient in both task
loops (against a hand-unrolled step, and stacked against sequential), that the meta-gradient reaches every tensor
with non-zero second-order terms, the consistency term over per-image text, the Dassl model, and an init file.
"""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from meta.finetune.engine import init_expectations
from meta.finetune.init_io import export_gram_init, load_gram_init
from meta.method.consistency import ConsistencySpec
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch, double_backward_attention
from meta.method.learners import (
    PromptLearner,
    feature_logits,
    learner_of,
    register_learner,
    text_only_structure,
    unregister_learner,
)
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.model.text_encoder import ClassTokenCache, encode_text_with_context
from trainers.gram.model import GramCLIP

KEY = "test_image_conditioned_context"
HIDDEN = 8  # CoCoOp: vis_dim // 16
TENSORS = ("ctx", "meta_w1", "meta_b1", "meta_w2", "meta_b2")
NAMES = ["apple", "boat", "red cat"]
OTHER = ["drum", "long thin eel", "fig"]
INNER_LR = 0.5


def meta_net(prompts, image: torch.Tensor) -> torch.Tensor:
    """π(f): ``image [..., n, E]`` -> ``[..., n, d_t]`` (leading task dims of θ and the images ride along)."""
    hidden = torch.relu(image @ prompts.meta_w1.transpose(-1, -2) + prompts.meta_b1.unsqueeze(-2))
    return hidden @ prompts.meta_w2.transpose(-1, -2) + prompts.meta_b2.unsqueeze(-2)


class ImageConditionedContext(PromptLearner):
    """CoCoOp's text context: ``ctx [M, d_t]`` shifted per image by a two-layer meta-net of the image feature."""

    key = KEY
    tensor_names = TENSORS
    per_image_text = True

    def structure_of(self, spec, dims) -> dict:
        return text_only_structure(spec.n_ctx_text, meta_input=dims.embed_dim, meta_hidden=HIDDEN)

    def shapes_of(self, structure, backbone) -> dict:
        m, e, h, d = structure["n_ctx_text"], structure["meta_input"], structure["meta_hidden"], backbone["text_width"]
        return {
            "ctx": ([m, d], "[prompt.n_ctx_text, backbone.text_width]"),
            "meta_w1": ([h, e], "[prompt.meta_hidden, prompt.meta_input]"),
            "meta_b1": ([h], "[prompt.meta_hidden]"),
            "meta_w2": ([d, h], "[backbone.text_width, prompt.meta_hidden]"),
            "meta_b2": ([d], "[backbone.text_width]"),
        }

    def init(self, spec, clip, dims, generator) -> dict:
        def linear(d_out: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:  # nn.Linear's default start
            bound = 1.0 / math.sqrt(d_in)
            draw = lambda *s: (torch.rand(*s, generator=generator) * 2 - 1) * bound  # noqa: E731
            return draw(d_out, d_in), draw(d_out)

        ctx = torch.randn(spec.n_ctx_text, dims.text_width, generator=generator) * spec.init_std
        w1, b1 = linear(HIDDEN, dims.embed_dim)
        w2, b2 = linear(dims.text_width, HIDDEN)
        return {"ctx": ctx, "meta_w1": w1, "meta_b1": b1, "meta_w2": w2, "meta_b2": b2}

    def check(self, tensors) -> None:
        super().check(tensors)
        if any(tensors.get(n) is None for n in TENSORS):
            raise ValueError(f"the image-conditioned context needs {', '.join(TENSORS)}")
        ctx, w1, b1, w2, b2 = (tensors[n] for n in TENSORS)
        if w1.shape[0] != b1.shape[0] or w2.shape != (ctx.shape[1], w1.shape[0]) or b2.shape[0] != ctx.shape[1]:
            raise ValueError("meta-net shapes: meta_w1 [h, E], meta_b1 [h], meta_w2 [d_t, h], meta_b2 [d_t]")

    def structure(self, prompts) -> dict:
        h, e = prompts.meta_w1.shape[-2:]
        return text_only_structure(prompts.ctx.shape[-2], meta_input=e, meta_hidden=h)

    def text_prompts(self, prompts):
        return prompts.ctx, None  # before any image's shift (the text side is the features methods' below)

    def visual_prompts(self, prompts):
        return None

    def spec_prompts_vision(self, spec) -> bool:
        return False

    def _text(self, pclip, prompts, image: torch.Tensor, names_per_row: list) -> torch.Tensor:
        """Text ``[..., n, K, E]``: row r of the ``[..., n]`` images with ``names_per_row[r]`` under its context."""
        ctx = prompts.ctx.unsqueeze(-3) + meta_net(prompts, image).unsqueeze(-2)  # [..., n, M, d_t]
        rows = ctx.reshape(-1, *ctx.shape[-2:])  # [N, M, d_t]
        k = len(names_per_row[0])
        flat = [c for names in names_per_row for c in names]
        return pclip.encode_text(rows.repeat_interleave(k, dim=0), None, flat).view(*ctx.shape[:-2], k, -1)

    def features(self, pclip, prompts, classnames, images=None, image_features=None):
        image = pclip.encode_images(images, None) if image_features is None else image_features
        return image, self._text(pclip, prompts, image, [list(classnames)] * image.shape[0])

    def stacked_features(self, pclip, prompts, classnames, images=None, image_features=None):
        n_tasks = len(classnames)
        image = image_features
        if image is None:
            image = pclip.encode_images(images, None).view(n_tasks, images.shape[0] // n_tasks, -1)
        rows = [list(names) for names in classnames for _ in range(image.shape[1])]
        return image, self._text(pclip, prompts, image, rows)


@contextlib.contextmanager
def conditional_learner() -> Iterator[str]:
    register_learner(ImageConditionedContext())
    try:
        yield KEY
    finally:
        unregister_learner(KEY)


@pytest.fixture
def toy():
    with conditional_learner() as key:
        yield key


def _theta(toy, clip, dims) -> PromptParams:
    spec = PromptSpec(n_ctx_text=2, learner=toy)
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # a shift of the size of the context, so the meta-net matters
        theta.meta_w2.mul_(0.2)
        theta.meta_b2.mul_(0.2)
    return theta


def _tasks(dims, n_tasks: int = 3, features: bool = True) -> list[TaskBatch]:
    gen = torch.Generator().manual_seed(3)

    def part(names, shots: int) -> dict:
        n = len(names) * shots
        batch = {"classnames": names, "label": torch.randperm(n, generator=gen) % len(names)}
        if features:
            batch["features"] = F.normalize(torch.randn(n, dims.embed_dim, generator=gen), dim=-1)
        else:
            batch["images"] = torch.randn(n, 3, dims.image_size, dims.image_size, generator=gen)
        return batch

    return [TaskBatch(part([NAMES, OTHER][b % 2], 1), part([NAMES, OTHER][b % 2], 2)) for b in range(n_tasks)]


def hand_logits(clip, scale: float, tensors: dict, names: list[str], image: torch.Tensor) -> torch.Tensor:
    """``[n, C]``, one image at a time with ``torch.nn.functional.linear`` (no learner, no PromptedCLIP)."""
    tokens = ClassTokenCache(clip, tensors["ctx"].shape[0], template="{}.").tokens(names)
    rows = []
    for f in image:
        shift = F.linear(torch.relu(F.linear(f, tensors["meta_w1"], tensors["meta_b1"])), tensors["meta_w2"])
        ctx = tensors["ctx"] + shift + tensors["meta_b2"]  # [M, d_t]: the same shift at every context position
        text = F.normalize(encode_text_with_context(clip, tokens, ctx), dim=-1)  # [C, E]
        rows.append(scale * (text @ f))
    return torch.stack(rows)


def test_logits_of_the_image_conditioned_learner_match_a_hand_computation(tiny_clip, toy):
    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    assert [n for n, _ in theta.named_parameters()] == list(TENSORS) and learner_of(theta).per_image_text
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    images = torch.randn(4, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(2))
    image, text = pclip.features(theta, NAMES, images=images)
    assert tuple(image.shape) == (4, dims.embed_dim) and tuple(text.shape) == (4, len(NAMES), dims.embed_dim)
    tensors = {n: p.detach() for n, p in theta.named_parameters()}
    want = hand_logits(clip, pclip.logit_scale, tensors, NAMES, F.normalize(clip.encode_image(images), dim=-1))
    with torch.no_grad():
        got = pclip.logits(theta, NAMES, images=images)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the images' contexts differ, so their text features do (the meta-net is not a no-op)
    assert (text[0] - text[1]).abs().max() > 1e-3
    # the task stack: task b of the stacked forward is the one-task forward of task b
    stack = SimpleNamespace(learner=toy, **{n: t.unsqueeze(0).expand(2, *t.shape) for n, t in tensors.items()})
    with torch.no_grad():
        img2, text2 = learner_of(theta).stacked_features(pclip, stack, [NAMES, OTHER], images=torch.cat([images] * 2))
        other = pclip.features(theta, OTHER, images=images)[1]
    assert tuple(img2.shape) == (2, 4, dims.embed_dim) and tuple(text2.shape) == (2, 4, len(NAMES), dims.embed_dim)
    torch.testing.assert_close(text2[1], other, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(feature_logits(pclip.logit_scale, img2, text2)[0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="text features depend on each image"):
        pclip.text_features(theta, NAMES)
    with pytest.raises(ValueError, match="feature_logits: expected image"):
        feature_logits(1.0, image, text.unsqueeze(0))


def test_meta_gradient_matches_a_hand_unrolled_second_order_step(tiny_clip, toy):
    """Sequential loop, R_φ at its identity start: ∇_θ (1/B) Σ_b L_q(θ − α ∇L_s(θ)) by hand, on all five tensors."""
    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    tasks = _tasks(dims, 2)
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    ml = GRAMMetaLearner(copy.deepcopy(theta), MetaSpec(inner_lr=INNER_LR, task_batching="off"))
    ml.accumulate(tasks, classification_loss(pclip))
    got = {n: p.grad for n, p in ml.prompt_module.named_parameters()}

    start = [p.detach().clone().requires_grad_() for p in theta.parameters()]

    def loss(tensors: list, batch: dict) -> torch.Tensor:
        logits = hand_logits(
            clip, pclip.logit_scale, dict(zip(TENSORS, tensors)), batch["classnames"], batch["features"]
        )
        return F.cross_entropy(logits, batch["label"])

    total = torch.zeros(())
    for task in tasks:
        with double_backward_attention():
            grads = torch.autograd.grad(loss(start, task.support), start, create_graph=True)
        total = total + loss([t - INNER_LR * g for t, g in zip(start, grads)], task.query) / len(tasks)
    want = dict(zip(TENSORS, torch.autograd.grad(total, start)))
    for name in TENSORS:
        assert want[name].abs().max() > 0, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4 * float(want[name].abs().max()))


def _meta_grads(theta, tasks, loss_fn, loop: str, first_order: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(4)  # R_φ's normal start draws from the global RNG: the same φ for every run
    spec = MetaSpec(inner_lr=INNER_LR, task_batching=loop, first_order=first_order)
    spec.regulator.init, spec.regulator.init_std = "normal", 0.2
    ml = GRAMMetaLearner(copy.deepcopy(theta), spec)
    if loop == "on":
        assert ml.task_batching.accumulate(ml, tasks, loss_fn) is not None  # the stacked pass ran, not the fallback
    else:
        ml.accumulate(tasks, loss_fn)
    return {n: p.grad.clone() for n, p in ml.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("features", [True, False], ids=["cached_features", "images"])
def test_stacked_task_loop_agrees_with_the_sequential_one(tiny_clip, toy, features):
    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    tasks = _tasks(dims, 3, features=features)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text))
    off, on = (_meta_grads(theta, tasks, loss_fn, loop) for loop in ("off", "on"))
    assert sorted(on) == sorted(off) and len(off) == 5 + 5 * 4  # θ: 5 tensors, R_φ: 4 per tensor
    for name, g in off.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(on[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))


def test_meta_gradient_reaches_the_meta_net_with_second_order_terms(tiny_clip, toy):
    """Both loops: every θ tensor (meta-net weights included) and every R_φ gets a gradient, and the second-order
    meta-gradient differs from the first-order one (the Hessian-vector terms through the meta-net are not 0)."""
    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    tasks = _tasks(dims, 2)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text))
    for loop in ("off", "on"):
        second = _meta_grads(theta, tasks, loss_fn, loop)
        first = _meta_grads(theta, tasks, loss_fn, loop, first_order=True)
        assert {n.rsplit(".", 1)[-1] for n in second if n.startswith("gbml.module.")} == set(TENSORS)
        for name in TENSORS:
            g2, g1 = second[f"gbml.module.{name}"], first[f"gbml.module.{name}"]
            assert g2.abs().max() > 0, (loop, name)
            assert (g2 - g1).abs().max() > 1e-3 * g2.abs().max(), (loop, name)  # second-order terms
        assert all(second[n].abs().max() > 0 for n in second if "compute_update" in n)


def test_consistency_over_per_image_text_is_the_mean_over_images(tiny_clip, toy):
    """KgCoOp's text term with per-image text: ``1 − mean_{i,k} cos(w_ik, w_k⁰)``; the Dassl model agrees."""
    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    images = torch.randn(3, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(6))
    batch = {"classnames": NAMES, "images": images, "label": torch.tensor([0, 2, 1])}
    spec = ConsistencySpec(text_weight=2.0)
    task, penalty, logits = classification_loss(pclip, spec).parts(theta, batch)
    with torch.no_grad():
        _, text = pclip.features(theta, NAMES, images=images)  # [n, C, E]
        zero_shot = F.normalize(clip.encode_text(clip_tokens(clip, NAMES)), dim=-1)  # [C, E]
    want = 2.0 * (1.0 - (text * zero_shot.unsqueeze(0)).sum(-1).mean())
    torch.testing.assert_close(penalty.detach(), want, rtol=1e-5, atol=1e-6)
    assert penalty.requires_grad and torch.autograd.grad(penalty, theta.meta_w1)[0].abs().max() > 0
    model = GramCLIP(clip, dims, theta, NAMES, consistency=spec)
    m_task, m_penalty, m_logits = model.training_loss_parts(images, batch["label"])
    torch.testing.assert_close(m_logits.detach(), logits.detach())
    torch.testing.assert_close(m_penalty.detach(), penalty.detach())
    torch.testing.assert_close(m_task.detach(), task.detach())


def clip_tokens(clip, names: list[str]) -> torch.Tensor:
    """open_clip token ids of CoOp's hand-made prompt for ``names`` (the frozen reference's text)."""
    import open_clip

    return open_clip.tokenize([f"a photo of a {n}." for n in names])


def test_dassl_model_classifies_per_image_and_an_init_file_round_trips(tmp_path, tiny_clip, toy):
    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    images = torch.randn(5, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(7))
    model = GramCLIP(clip, dims, theta, NAMES)
    with torch.no_grad():
        want = PromptedCLIP(clip, dims, theta.n_ctx_text).logits(theta, NAMES, images=images)
        torch.testing.assert_close(model(images), want)
    torch.testing.assert_close(model.predict(images), want)  # no cached text side: per image, every batch
    with torch.no_grad():
        # θ moves (not by a constant: LayerNorm removes a shift along the all-ones direction): predict follows
        # without reset_cache, nothing was cached
        theta.meta_w2.add_(torch.randn(theta.meta_w2.shape, generator=torch.Generator().manual_seed(8)))
    assert (model.predict(images) - want).abs().max() > 1e-4
    with pytest.raises(ValueError, match="text features depend on each image"):
        model.text_features()

    ml = GRAMMetaLearner(theta, MetaSpec(inner_lr=INNER_LR))
    path = export_gram_init(tmp_path / "cocoop_toy.safetensors", ml.prompt_module, ml.regulators(), dims)
    spec = PromptSpec(n_ctx_text=2, learner=toy)
    init = load_gram_init(path, expect=init_expectations(spec, dims))
    assert init.metadata["prompt"]["meta_hidden"] == HIDDEN and init.metadata["prompt"]["learner"] == toy
    loaded = init.prompt_module()
    for name, p in ml.prompt_module.named_parameters():
        assert torch.equal(getattr(loaded, name), p.detach()), name
    assert {n: r.dim for n, r in init.regulator_modules().items()} == {
        "ctx": dims.text_width,
        "meta_w1": dims.embed_dim,
        "meta_b1": HIDDEN,
        "meta_w2": HIDDEN,
        "meta_b2": dims.text_width,
    }
    with torch.no_grad():
        torch.testing.assert_close(GramCLIP(clip, dims, loaded, NAMES)(images), model(images))


@pytest.mark.dassl
def test_dassl_trainer_fine_tunes_the_learner_from_an_init_file(tmp_path, tiny_clip, toy):
    """``train.py``'s GRAM_CoOp trainer with ``TRAINER.GRAM.LEARNER`` = the toy and its init file: θ* is loaded as
    written, every tensor (meta-net weights included) moves in one epoch under R_φ, and the trainer's test accuracy is
    the one the learner's own logits give on the test split."""
    pytest.importorskip("dassl", reason="Dassl not installed: this test runs the Dassl trainer")
    from helpers_dassl import PROVENANCE, dassl_run, write_dtd

    from meta.method.regulator import GradientRegulator, RegulatorSpec

    clip, dims = tiny_clip
    write_dtd(tmp_path / "data")
    torch.save(clip.state_dict(), tmp_path / "tiny_clip.pt")
    theta = _theta(toy, clip, dims)
    torch.manual_seed(9)
    regs = {
        n: GradientRegulator(p.shape[-1], RegulatorSpec(init="normal", init_std=0.2))
        for n, p in theta.named_parameters()
    }
    init = export_gram_init(tmp_path / "toy.safetensors", theta, regs, dims, provenance=PROVENANCE)
    opts = ["TRAINER.GRAM.LEARNER", toy, "TRAINER.GRAM.N_CTX_TEXT", "2", "TRAINER.GRAM.INIT", str(init)]
    trainer, _ = dassl_run(tmp_path, "gram_coop", opts, "base", tmp_path / "out")
    model = trainer.model
    for name, p in theta.named_parameters():
        assert torch.equal(getattr(model.prompt_learner, name).detach(), p.detach()), name
    trainer.train()  # launch step, one epoch, the base test
    for name, p in theta.named_parameters():
        assert (getattr(model.prompt_learner, name).detach() - p.detach()).abs().max() > 1e-5, name
    accuracy = trainer.test()
    pclip = PromptedCLIP(clip, dims, 2)
    correct = total = 0
    with torch.no_grad():
        for batch in trainer.test_loader:
            logits = pclip.logits(model.prompt_learner, model.classnames, images=batch["img"])
            torch.testing.assert_close(trainer.model_inference(batch["img"]), logits)  # what test() scored
            correct += int((logits.argmax(1) == batch["label"]).sum())
            total += len(batch["label"])
    assert total == 20 and accuracy == pytest.approx(100.0 * correct / total)


def test_the_evaluator_scores_the_learner_per_image(tiny_clip, toy):
    """The standalone evaluator's accuracy (``PromptTuner.accuracy``) scores each image with its own text features:
    the share of images whose hand-computed logits put the true class first, from images and from cached features."""
    from meta.evaluation.spec import TrainSpec
    from meta.evaluation.training import LabelledSet, PromptTuner

    clip, dims = tiny_clip
    theta = _theta(toy, clip, dims)
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    gen = torch.Generator().manual_seed(4)
    images = torch.randn(7, 3, dims.image_size, dims.image_size, generator=gen)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 1])
    with torch.no_grad():
        feats = F.normalize(clip.encode_image(images), dim=-1)
        tensors = {n: p.detach() for n, p in theta.named_parameters()}
        hand = hand_logits(clip, 1.0, tensors, NAMES, feats).argmax(dim=1)
    want = 100.0 * float((hand == labels).float().mean())
    paths = [str(i) for i in range(len(labels))]
    spec = TrainSpec(epochs=0, test_batch_size=3)  # three batches: 3 + 3 + 1 images
    tuner = PromptTuner(pclip, theta, None, spec, 0, lambda p, v: images[int(p)], lambda p: images[int(p)])
    with torch.no_grad():
        from_images = tuner.accuracy(LabelledSet(paths, labels, NAMES))
        from_features = tuner.accuracy(LabelledSet(paths, labels, NAMES, features=feats))
    assert from_images == pytest.approx(want) and from_features == pytest.approx(want)
    assert 0 < want < 100  # the check can tell a wrong pairing of images and texts from a right one
