"""``META.SUPPORT_ATTENTION_LOWP``: the second-order support pass's attention products in the autocast dtype.

PyTorch's MATH attention kernel (the one with a double backward, which the support pass of a second-order step
needs) upcasts bf16/fp16 queries, keys and values to fp32; on a GPU those products run as fp32 GEMMs without tensor
cores (the FFMA kernels of the H200 step profile).  The key keeps them in bf16.  CPU autocast dispatches the same
casts as CUDA autocast, so the census and the numbers are tested here; the speed is the GPU profile's
(``python -m gram_tools.profile_gpu``, ``bf16_support_attention_lowp``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers_steps import meta_gradients, stacked_step

from gram_tools.profile_gpu import product_dtypes
from meta.method.gram import double_backward_attention


def _step(tiny_clip, autocast: str, lowp: bool, regulate: bool = True):
    """``(run, learner)`` of one stacked second-order step of 2 VPT tasks (:func:`helpers_steps.stacked_step`)."""
    vpt = {"n_ctx_text": 0, "n_ctx_vision": 2}
    return stacked_step(tiny_clip, vpt, autocast=autocast, regulate=regulate, support_attention_lowp=lowp)


def test_the_math_kernel_computes_attention_in_fp32_and_the_key_keeps_it_in_bf16(tiny_clip):
    """Under bf16 autocast without R_φ every product of the step runs in bf16 with the key; without it the support
    pass's attention products run in fp32 (as many as move to bf16 with the key: none added, none lost)."""
    counts = {}
    for lowp in (False, True):
        run, _ = _step(tiny_clip, "bf16", lowp, regulate=False)
        counts[lowp] = product_dtypes(run)
        assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # the process flag is restored
    assert counts[False].get("float32", 0) > 0 and "mixed" not in counts[False]
    assert counts[True] == {"bfloat16": counts[False]["bfloat16"] + counts[False]["float32"]}


def test_with_r_phi_the_only_fp32_products_left_are_r_phis(tiny_clip):
    """R_φ's maps stay fp32 (the regulated gradient's precision; a [B·n, d] x [d, d] product): the fp32 products
    with the key are exactly those the step with R_φ adds to the step without it."""

    def census(regulate, lowp):
        return product_dtypes(_step(tiny_clip, "bf16", lowp, regulate)[0])

    with_r, without_r = census(True, True), census(False, True)
    added = census(True, False)["float32"] - census(False, False)["float32"]
    assert added > 0 and with_r["float32"] == added and "float32" not in without_r


def test_no_effect_in_fp32(tiny_clip):
    """Without autocast (fp32 weights, the CPU runs and their fingerprints) the key changes no bit of θ's or φ's
    gradient."""
    grads = []
    for lowp in (False, True):
        run, ml = _step(tiny_clip, "none", lowp)
        run()
        grads.append(meta_gradients(ml))
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 2
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_the_flag_is_restored_after_an_error():
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    with pytest.raises(RuntimeError, match="inside"):
        with double_backward_attention(low_precision=True):
            assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            raise RuntimeError("inside")
    assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() == before


def _reference(q, k, v, mask):
    """softmax(q kᵀ / √d + mask) v in float64, written out."""
    q, k, v, mask = (t.double() for t in (q, k, v, mask))
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask, dim=-1) @ v


@pytest.mark.parametrize("lowp", [False, True], ids=["fp32_products", "bf16_products"])
def test_low_precision_math_attention_and_its_double_backward_against_float64(lowp):
    """The MATH kernel on bf16 inputs: output, the gradient taken with ``create_graph`` and the gradient of that
    gradient (what a second-order step differentiates) agree with a float64 computation within bf16's precision;
    with the key the error is larger than without it, and still small."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, 3, 17, 16)  # [N, H, L, head dim]
    q64, k64, v64 = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.full((17, 17), float("-inf")).triu(1)  # causal, as the text tower's
    w1, w2 = torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen)

    def derivatives(q, k, v, m, attend):
        q = q.clone().requires_grad_(True)
        out = attend(q, k, v, m)
        (g,) = torch.autograd.grad((out * w1.to(out.dtype)).sum(), q, create_graph=True)
        (gg,) = torch.autograd.grad((g * w2.to(g.dtype)).sum(), q)
        return [t.double() for t in (out, g, gg)]

    ref = derivatives(q64, k64, v64, mask.double(), _reference)
    with double_backward_attention(low_precision=lowp):
        got = derivatives(
            *(t.bfloat16() for t in (q64, k64, v64, mask)),
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        )
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
    assert max(errors) < 0.02, errors
    if lowp:  # rounding scores and probabilities to bf16 costs accuracy over the fp32 products
        with double_backward_attention(low_precision=False):
            fp32 = derivatives(
                *(t.bfloat16() for t in (q64, k64, v64, mask)),
                lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            )
        assert errors[0] > ((fp32[0] - ref[0]).norm() / ref[0].norm()).item()
