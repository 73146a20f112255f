"""Episodic test-time prompt tuning (meta/finetune/testtime.py, TPT's protocol) on the tiny CLIP: the entropy loss
against a float64 hand computation and finite differences, confident-view selection, two AdamW steps against a hand
computation, reset between images, R_φ acting on the entropy gradient, the peak memory per image, and the one-line
errors."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from meta.finetune.regulated import GradientRegulation, LaunchStep
from meta.finetune.testtime import (
    TestTimeSpec,
    confident_views,
    image_generator,
    marginal_entropy,
    tune_and_predict,
    view_batch,
)
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec
from meta.method.regulator import GradientRegulator, RegulatorSpec
from meta.model.backbone import load_clip

NAMES = ["cat", "dog", "tree"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    clip, dims = load_clip("GRAM-Test-Tiny", None)
    theta = PromptParams.from_spec(PromptSpec(n_ctx_text=2), clip, dims, generator=torch.Generator().manual_seed(1))
    images = torch.randn(3, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(2))
    return PromptedCLIP(clip, dims, theta.n_ctx_text), theta, images


def _hand_entropy(logits: np.ndarray, kept: int) -> float:
    """float64: the entropy of the mean softmax of the ``kept`` rows of lowest entropy."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    rows = np.argsort(-(p * np.log(p)).sum(axis=1), kind="stable")[:kept]
    mean = p[rows].mean(axis=0)
    return float(-(mean * np.log(mean)).sum())


def test_the_loss_is_the_entropy_of_the_confident_views_mean_prediction():
    logits = torch.randn(16, 5, generator=torch.Generator().manual_seed(3)) * 3
    got = marginal_entropy(logits[confident_views(logits, 4)])
    assert float(got) == pytest.approx(_hand_entropy(logits.double().numpy(), 4), rel=1e-5)
    # its gradient against float64 finite differences
    x = logits[:4].double().requires_grad_(True)
    assert torch.autograd.gradcheck(marginal_entropy, (x,))
    # selection: a one-hot-like row is the most confident, a flat row the least
    rows = torch.zeros(4, 3)
    rows[2] = torch.tensor([9.0, 0.0, 0.0])
    rows[0] = torch.tensor([2.0, 0.0, 0.0])
    assert confident_views(rows, 2).tolist() == [2, 0]
    assert TestTimeSpec().kept == 6 and TestTimeSpec(views=5).kept == 1  # int(64 x 0.1), at least one


def test_views_start_with_the_image_and_are_drawn_from_the_given_generator(tiny):
    _, _, images = tiny
    spec = TestTimeSpec(views=6)
    a = view_batch(images[0], spec, image_generator(0, 0))
    assert a.shape == (6, *images[0].shape) and torch.equal(a[0], images[0])
    assert torch.equal(a, view_batch(images[0], spec, image_generator(0, 0)))
    assert not torch.equal(a, view_batch(images[0], spec, image_generator(0, 1)))
    assert all(not torch.equal(a[i], images[0]) for i in range(1, 6))


def _adamw(theta: torch.Tensor, grads: list, spec: TestTimeSpec) -> torch.Tensor:
    """AdamW by hand (Loshchilov & Hutter; torch's defaults betas (0.9, 0.999), eps 1e-8) over ``grads``."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        theta = theta * (1 - spec.lr * spec.weight_decay)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        theta = theta - spec.lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return theta


def test_two_entropy_steps_match_a_hand_computation_and_predict_on_the_image(tiny):
    pclip, theta, images = tiny
    spec = TestTimeSpec(views=8, confident_share=0.25, steps=2, lr=0.05)
    result = tune_and_predict(pclip, theta, images[:1], NAMES, spec, seed=7)
    views = view_batch(images[0], spec, image_generator(7, 0))
    with torch.no_grad():
        feats = pclip.image_features(None, views)
    ctx, grads = theta.ctx.detach().clone(), []
    for _ in range(2):  # the loss and its gradient at the current θ, then AdamW by hand
        probe = copy.deepcopy(theta)
        probe.ctx.data.copy_(ctx)
        logits = pclip.logits(probe, NAMES, image_features=feats)
        p = logits.softmax(-1)
        keep = torch.argsort(-(p * p.log()).sum(-1), stable=True)[:2]
        mean = p[keep].mean(0)
        (grad,) = torch.autograd.grad(-(mean * mean.log()).sum(), probe.ctx)
        grads.append(grad)
        ctx = _adamw(theta.ctx.detach(), grads, spec)
    probe = copy.deepcopy(theta)
    probe.ctx.data.copy_(ctx)
    with torch.no_grad():
        expected = pclip.logits(probe, NAMES, images=images[:1])[0]
    torch.testing.assert_close(result.logits[0], expected, rtol=1e-4, atol=1e-4)
    assert result.loss_after < result.loss_before  # the entropy went down on this image


def test_each_image_starts_from_theta_and_nothing_leaks_into_the_next(tiny):
    pclip, theta, images = tiny
    before = {k: v.detach().clone() for k, v in theta.named_parameters()}
    spec = TestTimeSpec(views=4, steps=2, lr=0.1)
    ab = tune_and_predict(pclip, theta, images[[0, 2]], NAMES, spec)
    cb = tune_and_predict(pclip, theta, images[[1, 2]], NAMES, spec)
    assert torch.equal(ab.logits[1], cb.logits[1])  # image 2's result whatever was tuned before it
    assert not torch.allclose(ab.logits[0], cb.logits[0])
    assert all(torch.equal(v, before[k]) for k, v in theta.named_parameters())  # start θ untouched
    zero_step = tune_and_predict(pclip, theta, images[:1], NAMES, TestTimeSpec(views=4, steps=0))
    with torch.no_grad():
        torch.testing.assert_close(zero_step.logits, pclip.logits(theta, NAMES, images=images[:1]))


def test_the_peak_memory_per_image_is_the_largest_resident_growth_and_null_without_a_reset(tiny, monkeypatch):
    """The kernel's resident counters are read through meta.infra.memory; scripted here (the real ones lag and reuse
    pages, so a real allocation's growth is not a stable test): per image the high-water mark above the resident
    size before its tuning, the largest over the set; null where the mark cannot be reset, the results unchanged."""
    from meta.infra import memory

    pclip, theta, images = tiny
    spec = TestTimeSpec(views=4, steps=1)
    plain = tune_and_predict(pclip, theta, images, NAMES, spec)
    growth_mib = iter([10.0, 70.0, 20.0])  # images 0, 1, 2
    readings: list = []

    def status_kib(field: str) -> int:
        if field == "VmRSS":
            readings.append(1000 + 7 * len(readings))  # a different resident size before each image
            return readings[-1]
        return readings[-1] + int(next(growth_mib) * 1024)

    monkeypatch.setattr(memory, "reset_hwm", lambda: True)
    monkeypatch.setattr(memory, "status_kib", status_kib)
    scripted = tune_and_predict(pclip, theta, images, NAMES, spec)
    assert len(readings) == 3 and scripted.peak_mib_per_image == pytest.approx(70.0)
    assert torch.equal(scripted.logits, plain.logits)
    monkeypatch.setattr(memory, "reset_hwm", lambda: False)  # off Linux: recorded null, the results unchanged
    off = tune_and_predict(pclip, theta, images, NAMES, spec)
    assert off.peak_mib_per_image is None and torch.equal(off.logits, plain.logits)


def test_r_phi_replaces_the_entropy_gradient_before_the_step(tiny):
    pclip, theta, images = tiny
    spec = TestTimeSpec(views=4, steps=1, lr=0.01, weight_decay=0.0)
    reg = GradientRegulator(theta.ctx.shape[-1], RegulatorSpec(form="paper"))
    with torch.no_grad():
        reg.gamma.bias.fill_(-20.0)  # γ = tanh(-20) = -1, β = 0: R_φ(g) = -g
    flipped = GradientRegulation({"ctx": reg})
    plain = tune_and_predict(pclip, theta, images[:1], NAMES, spec)
    regulated = tune_and_predict(pclip, theta, images[:1], NAMES, spec, regulation=flipped)
    assert flipped.summary()["reg_cos"] == pytest.approx(-1.0, abs=1e-6)
    assert regulated.loss_after > regulated.loss_before  # the step climbed the entropy
    assert plain.loss_after < plain.loss_before


def test_the_meta_optimizer_takes_the_init_files_regulated_step_and_needs_one(tiny):
    pclip, theta, images = tiny
    spec = TestTimeSpec(views=8, confident_share=0.25, steps=1, optimizer="meta")
    reg = GradientRegulator(theta.ctx.shape[-1], RegulatorSpec(form="residual"))
    with torch.no_grad():
        for p in reg.parameters():
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    regulation = GradientRegulation({"ctx": reg})
    rule = LaunchStep(alpha=0.7, weight_decay=0.01)
    result = tune_and_predict(pclip, theta, images[:1], NAMES, spec, regulation=regulation, seed=7, rule=rule)
    views = view_batch(images[0], spec, image_generator(7, 0))
    probe = copy.deepcopy(theta)
    with torch.no_grad():
        feats = pclip.image_features(None, views)
    logits = pclip.logits(probe, NAMES, image_features=feats)
    p = logits.softmax(-1)
    keep = torch.argsort(-(p * p.log()).sum(-1), stable=True)[:2]
    mean = p[keep].mean(0)
    (grad,) = torch.autograd.grad(-(mean * mean.log()).sum(), probe.ctx)
    with torch.no_grad():  # θ − α (R_φ(g) + λ θ): the meta-trained inner rule, by hand
        probe.ctx.copy_(theta.ctx - 0.7 * (reg(grad) + 0.01 * theta.ctx))
        expected = pclip.logits(probe, NAMES, images=images[:1])[0]
    torch.testing.assert_close(result.logits[0], expected, rtol=1e-4, atol=1e-4)
    adamw = tune_and_predict(
        pclip, theta, images[:1], NAMES, replace(spec, optimizer="adamw"), regulation=regulation, seed=7
    )
    assert not torch.allclose(adamw.logits[0], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"^test-time optimizer meta: needs the meta-trained step of a GRAM init file"):
        tune_and_predict(pclip, theta, images[:1], NAMES, spec, regulation=regulation)
    with pytest.raises(ValueError, match=r"^test-time optimizer: expected adamw \| meta, got 'sgd'$"):
        TestTimeSpec(optimizer="sgd")


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"views": 0}, "views"),
        ({"confident_share": 0.0}, "confident_share"),
        ({"steps": -1}, "steps"),
        ({"lr": 0}, "lr"),
    ],
)
def test_bad_settings_and_no_images_end_in_one_line_naming_the_key(fields, key, tiny):
    with pytest.raises(ValueError, match=f"test-time {key}: expected") as err:
        TestTimeSpec(**fields)
    assert "\n" not in str(err.value)
    pclip, theta, images = tiny
    with pytest.raises(ValueError, match=r"expected unlabelled images \[n >= 1"):
        tune_and_predict(pclip, theta, images[:0], NAMES)
