"""meta.finetune.engine on its own: the window's one unit conversion, the regulated step (with a GradScaler: R_φ sees
the unscaled gradient) and the start rules that MethodSpec and TRAINER.GRAM share."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from yacs.config import CfgNode as CN

from meta.evaluation import MethodSpec
from meta.finetune.engine import RegulatedStepper, window_batches
from meta.finetune.regulated import GradientRegulation
from meta.method.regulator import GradientRegulator, RegulatorSpec
from trainers.gram.config import extend_cfg, gram_settings


@pytest.mark.parametrize(
    "images, batch, batches", [(4, 2, 2), (1, 4, 1), (3, 2, 2), (5, 2, 2), (20, 1, 20), (20, 4, 5), (6, 4, 2)]
)
def test_window_in_images_becomes_whole_batches_rounded_and_at_least_one(images, batch, batches):
    assert window_batches(images, batch) == batches


def test_window_batches_refuses_an_unresolved_or_empty_window():
    with pytest.raises(ValueError, match="images >= 1"):
        window_batches(0, 2)


class _Theta(nn.Module):
    def __init__(self):
        super().__init__()
        self.ctx = nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))


def _loss(theta: _Theta, x: torch.Tensor) -> torch.Tensor:
    return ((theta.ctx * x).sum(-1) ** 2).mean() + (theta.ctx**3).sum() * x.mean()


def _regulator() -> GradientRegulator:
    torch.manual_seed(3)
    return GradientRegulator(4, RegulatorSpec(init="normal", init_std=0.3))


@pytest.mark.parametrize("scale", [None, 64.0])
def test_stepper_regulates_the_window_mean_once_and_steps_once(scale):
    """Three batches, window 2: after batch 1 nothing moves; after batch 2, θ -= lr · 2 R_φ((g1 + g2) / 2); the
    epoch's last batch closes a window of one: θ -= lr · R_φ(g3).  A GradScaler gives the same θ (R_φ sees the
    unscaled gradient), computed here without one."""
    xs = [torch.full((3, 4), v) for v in (0.5, -0.25, 1.0)]
    reg = _regulator()
    theta = _Theta()
    opt = torch.optim.SGD(theta.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
    stepper = RegulatedStepper(theta, opt, GradientRegulation({"ctx": reg}), window=2, scaler=scaler)
    start = theta.ctx.detach().clone()
    assert stepper.backward(_loss(theta, xs[0])) == 0
    assert torch.equal(theta.ctx.detach(), start)

    def grad(ctx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        view = _Theta()
        with torch.no_grad():
            view.ctx.copy_(ctx)
        return torch.autograd.grad(_loss(view, x), view.ctx)[0]

    mean = (grad(start, xs[0]) + grad(start, xs[1])) / 2
    with torch.no_grad():
        expected = start - 0.1 * 2 * reg(mean)
    assert stepper.backward(_loss(theta, xs[1])) == 2
    torch.testing.assert_close(theta.ctx.detach(), expected)
    g3 = grad(expected, xs[2])
    with torch.no_grad():
        expected = expected - 0.1 * reg(g3)
    assert stepper.backward(_loss(theta, xs[2]), last=True) == 1
    torch.testing.assert_close(theta.ctx.detach(), expected)
    assert theta.ctx.grad is None


def _cfg(**keys) -> CN:
    cfg = CN()
    cfg.TRAINER = CN()
    cfg.TRAINER.NAME = "GRAM_VPT"
    cfg.MODEL = CN()
    cfg.MODEL.BACKBONE = CN()
    cfg.MODEL.BACKBONE.NAME = "ViT-B/16"
    extend_cfg(cfg)
    for key, value in keys.items():
        cfg.TRAINER.GRAM[key] = value
    return cfg


@pytest.mark.parametrize(
    "fields, keys, method_msg, dassl_msg",
    [
        (
            dict(vpt_init="gauss"),
            dict(VPT_INIT="gauss"),
            "vpt_init must be one of",
            "TRAINER.GRAM.VPT_INIT: must be one of",
        ),
        (
            dict(reg_window=-1),
            dict(REG_WINDOW_IMAGES=-1),
            "reg_window must be >= 0 images",
            "TRAINER.GRAM.REG_WINDOW_IMAGES: must be >= 0 images",
        ),
        (
            dict(template="a photo"),
            dict(TEMPLATE="a photo"),
            "template must contain '{}'",
            "TRAINER.GRAM.TEMPLATE: must contain '{}'",
        ),
        (
            dict(init_path="x.safetensors", init_prompts=False, regulate=False),
            dict(ENABLED=True, INIT="x.safetensors", INIT_PROMPTS=False, REGULATE=False),
            "neither θ* (init_prompts) nor R_φ",
            "TRAINER.GRAM.INIT_PROMPTS: or regulate must be on",
        ),
    ],
)
def test_the_evaluator_and_the_trainers_refuse_the_same_starts(fields, keys, method_msg, dassl_msg):
    """One rule set (meta.finetune.engine.start_rule_problems), each interface naming its own keys (VPT: no text)."""
    with pytest.raises(ValueError) as err:
        MethodSpec("x", n_ctx_text=0, n_ctx_vision=4, **fields)
    assert method_msg in str(err.value) and str(err.value).startswith("MethodSpec 'x': ")
    with pytest.raises(ValueError) as err:
        gram_settings(_cfg(**keys))
    assert dassl_msg in str(err.value)
