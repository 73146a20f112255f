"""``META.CLOSED_FORM_LAYER_NORM``: the second-order support pass's LayerNorms with a hand-derived double backward.

Checked against autograd's own double backward of ``F.layer_norm`` (float64, independent code paths), with
``gradgradcheck`` (finite differences), on open_clip's two LayerNorm classes (forward values bit-identical), through
a whole stacked second-order step of VPT and UNIGRAM (meta-gradient equal to rounding), and in the step's memory
traffic (``gram_tools.step_traffic``: the double backward's bytes about halved)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_steps import meta_gradients, stacked_step
from open_clip.transformer import LayerNorm, LayerNormFp32

from meta.model.layer_norm import apply_norm, closed_form_active, closed_form_layer_norm, layer_norm

F64 = torch.float64


def _second_order(fn, x: torch.Tensor, probe: torch.Tensor, tangent: torch.Tensor):
    """``(y, gx, ∂<tangent, gx>/∂x, ∂<tangent, gx>/∂probe)`` for the loss ``<fn(x), probe>``."""
    y = fn(x)
    (gx,) = torch.autograd.grad((y * probe).sum(), x, create_graph=True)
    dx, dprobe = torch.autograd.grad((gx * tangent).sum(), [x, probe])
    return y.detach(), gx.detach(), dx, dprobe


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_weight"])
def test_the_closed_form_equals_autograds_double_backward(affine):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, dtype=F64, generator=gen) * 3 + 1).requires_grad_()
    probe = torch.randn(3, 5, 16, dtype=F64, generator=gen).requires_grad_()  # the output gradient g depends on it
    tangent = torch.randn(3, 5, 16, dtype=F64, generator=gen)
    w = torch.randn(16, dtype=F64, generator=gen) if affine else None
    b = torch.randn(16, dtype=F64, generator=gen) if affine else None
    ours = _second_order(lambda t: layer_norm(t, w, b, 1e-5), x, probe, tangent)
    theirs = _second_order(lambda t: F.layer_norm(t, (16,), w, b, 1e-5), x, probe, tangent)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])  # PyTorch's own kernels
    for a, b_ in zip(ours[2:], theirs[2:]):
        assert torch.allclose(a, b_, rtol=1e-12, atol=1e-12)
    assert ours[2].abs().max() > 1e-3  # the second-order term is not trivially zero


def test_gradgradcheck_against_finite_differences():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(7, dtype=F64, generator=gen), torch.randn(7, dtype=F64, generator=gen)
    x = torch.randn(4, 7, dtype=F64, generator=gen).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: layer_norm(t, w, b, 1e-5), (x,))


@pytest.mark.parametrize("cls", [LayerNorm, LayerNormFp32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_norm_gives_open_clips_values_and_picks_its_backward(cls, dtype):
    ln = cls(12).requires_grad_(False)
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.2), ln.bias.normal_(0.0, 0.2)
    x = torch.randn(4, 12).to(dtype).requires_grad_()
    plain = apply_norm(ln, x)
    assert torch.equal(plain, ln(x)) and type(plain.grad_fn).__name__ == ln(x).grad_fn.__class__.__name__
    with closed_form_layer_norm():
        assert closed_form_active(ln)
        ours = apply_norm(ln, x)
    assert not closed_form_active(ln)  # the context ends
    assert ours.dtype == dtype and torch.equal(ours, ln(x))
    names = set()
    node = ours.grad_fn
    while node is not None and node.next_functions:
        names.add(type(node).__name__)
        node = node.next_functions[0][0]
    assert "_LayerNormBackward" in names and not any("NativeLayerNorm" in n for n in names)


def test_a_norm_with_trainable_weights_or_another_kind_keeps_autograds_path():
    trainable = LayerNorm(8)
    plain = torch.nn.LayerNorm(8).requires_grad_(False)
    with closed_form_layer_norm():
        assert not closed_form_active(trainable) and not closed_form_active(plain)
        y = apply_norm(trainable, torch.randn(2, 8))
    assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0"


def _meta_gradient(tiny_clip, learner: dict, closed_form: bool, autocast: str = "none") -> dict:
    """Metrics and θ's and φ's gradients of one stacked second-order step of 2 tasks (a non-trivial R_φ)."""
    run, ml = stacked_step(tiny_clip, learner, autocast=autocast, closed_form_layer_norm=closed_form)
    return {"metrics": run(), "grads": meta_gradients(ml)}


@pytest.mark.parametrize(
    "learner",
    [
        {"n_ctx_text": 0, "n_ctx_vision": 2},
        {"n_ctx_text": 2, "n_ctx_vision": 2},
        {"n_ctx_text": 2, "n_ctx_vision": 2, "text_depth": 0, "vision_depth": 0, "vpt_init": "normal"},
    ],
    ids=["vpt", "unigram", "ivlp_deep"],
)
def test_the_meta_gradient_equals_autograds_to_rounding(tiny_clip, learner):
    off = _meta_gradient(tiny_clip, learner, closed_form=False)
    on = _meta_gradient(tiny_clip, learner, closed_form=True)
    assert on["metrics"] == off["metrics"]  # losses and accuracies: forward kernels unchanged
    assert off["grads"].keys() == on["grads"].keys() and len(off["grads"]) >= 3  # θ and φ's maps
    for name, g in off["grads"].items():
        assert torch.allclose(on["grads"][name], g, rtol=1e-4, atol=1e-7 * g.abs().max()), name
        assert g.abs().max() > 0


def test_under_bf16_autocast_the_meta_gradient_stays_close(tiny_clip):
    learner = {"n_ctx_text": 2, "n_ctx_vision": 2}
    off = _meta_gradient(tiny_clip, learner, closed_form=False, autocast="bf16")["grads"]
    on = _meta_gradient(tiny_clip, learner, closed_form=True, autocast="bf16")["grads"]
    flat_off = torch.cat([g.flatten() for g in off.values()])
    flat_on = torch.cat([on[n].flatten() for n in off])
    assert F.cosine_similarity(flat_on, flat_off, dim=0) > 0.9999


def test_the_closed_form_halves_the_double_backwards_bytes():
    from gram_tools.step_traffic import step_census

    size = {"way": 3, "support_shots": 1, "query_shots": 2}

    def double_backward(closed_form: bool) -> tuple[int, int]:
        census = step_census("vpt", model="GRAM-Test-Tiny", size=size, tasks=2, closed_form_norm=closed_form)
        nodes = census.totals("node")
        return sum(t.bytes for n, t in nodes.items() if "LayerNormBackwardBackward" in n), sum(
            r.bytes for r in census.records
        )

    (norm_off, total_off), (norm_on, total_on) = double_backward(False), double_backward(True)
    assert 0 < norm_on < 0.6 * norm_off
    assert total_off - total_on == pytest.approx(norm_off - norm_on, rel=0.05)
