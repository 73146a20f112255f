"""meta.method.travel.TravelSplit against the observed travel and a hand-kept β momentum buffer."""

import pytest
import torch

from meta.finetune.regulated import GradientRegulation
from meta.method.regulator import GradientRegulator, RegulatorSpec
from meta.method.travel import TravelSplit


def _run(zero_beta=False, steps=6, window=2, seed=0, record=True):
    torch.manual_seed(seed)
    reg = GradientRegulator(5, RegulatorSpec(init="normal", init_std=0.4))
    if zero_beta:  # β's map at zero: β = rms(g) · tanh(0) = 0, ĝ = γ ⊙ g
        with torch.no_grad():
            reg.beta.weight.zero_()
    regulation = GradientRegulation({"ctx": reg})
    ctx = torch.nn.Parameter(torch.randn(3, 5))
    other = torch.nn.Parameter(torch.randn(4))  # not regulated: all of its travel is "not β"
    targets = torch.randn(steps * window, 3, 5)
    opt = torch.optim.SGD([ctx, other], lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    start = ctx.detach().clone()
    hand_vb, hand_travel_b = None, torch.zeros(3, 5)
    split = TravelSplit()
    with split:
        for t in range(steps):
            for w in range(window):  # a regulation window of 2 summed gradients
                loss = ((ctx - targets[t * window + w]) ** 2).sum() * 0.5 + (other**2).sum() * (ctx.sum() ** 2) * 0.01
                loss.backward()
            # β part of the step, by hand: count · β(ĝ input) of the window's mean gradient
            g_mean = ctx.grad.detach() / window
            rms = g_mean.pow(2).mean().add(1e-12).sqrt()
            u = g_mean / rms
            b = rms * torch.tanh(u @ reg.beta.weight.T + reg.beta.bias)
            b = (b * window).detach()
            hand_vb = b if hand_vb is None else 0.9 * hand_vb + b
            hand_travel_b -= opt.param_groups[0]["lr"] * hand_vb
            regulation.apply_([("ctx", ctx), ("other", other)], count=window)
            opt.step()
            opt.zero_grad()
            sched.step()
    return split, ctx.detach() - start, hand_travel_b, ctx


def test_travel_split_matches_observed_travel_and_hand_kept_beta_buffer():
    split, observed, hand_b, ctx = _run()
    st = split.per_param[id(ctx)]
    torch.testing.assert_close(st["travel"], observed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st["travel_beta"], hand_b, rtol=1e-5, atol=1e-7)
    s = split.summary()
    assert s["steps"] == 6 and s["unpaired"] == 6  # the unregulated tensor, once per step
    assert 0 < s["beta_share"] < 5 and s["beta_travel_norm"] > 0
    assert s["beta_projection"] == pytest.approx(
        float(
            torch.cat([hand_b.flatten(), torch.zeros(4)])
            @ torch.cat(
                [
                    observed.flatten(),
                    split.per_param[[k for k in split.per_param if k != id(ctx)][0]]["travel"].flatten(),
                ]
            )
        )
        / s["travel_norm"] ** 2,
        rel=1e-4,
    )


def test_regulator_without_beta_has_no_beta_travel_and_forward_is_restored():
    original = GradientRegulator.forward
    split, observed, hand_b, ctx = _run(zero_beta=True)
    assert GradientRegulator.forward is original
    assert float(hand_b.abs().max()) == 0.0
    assert split.summary()["beta_travel_norm"] == 0.0
    torch.testing.assert_close(split.per_param[id(ctx)]["travel"], observed, rtol=1e-5, atol=1e-6)
