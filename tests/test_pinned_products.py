"""The pinned matrix products (meta.infra.products): numpy's OpenBLAS behind ATen's CPU mm / addmm / bmm / baddbmm."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from meta.infra import products
from meta.infra.numerics import PINS, pinned


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def test_installed_in_a_pinned_process():
    assert pinned(), "the test suite runs pinned (conftest.py)"
    assert products.state()["kernel"] == products.KERNEL


def test_products_are_numpys_openblas_products():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(70, 300, generator=gen), torch.randn(300, 90, generator=gen)
    expected = a.numpy() @ b.numpy()  # numpy's own call: the independent computation of the same bits
    assert _bits(a @ b) == hashlib.sha256(expected.tobytes()).hexdigest()
    assert _bits(torch.mm(a, b)) == _bits(torch.from_numpy(expected))
    # the fp32 product is close to the float64 one (it is a product, not only a deterministic number)
    exact = a.double() @ b.double()
    assert torch.allclose((a @ b).double(), exact, rtol=1e-5, atol=1e-4)
    batch_a, batch_b = torch.randn(3, 20, 30, generator=gen), torch.randn(3, 30, 10, generator=gen)
    assert _bits(torch.bmm(batch_a, batch_b)) == _bits(torch.from_numpy(batch_a.numpy() @ batch_b.numpy()))


def test_addmm_and_baddbmm_follow_atens_definition():
    gen = torch.Generator().manual_seed(1)
    bias, a, b = torch.randn(6, generator=gen), torch.randn(5, 4, generator=gen), torch.randn(4, 6, generator=gen)
    got = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    assert torch.allclose(got.double(), 0.5 * bias.double() + 2.0 * (a.double() @ b.double()), atol=1e-5)
    nan_bias = torch.full((5, 6), float("nan"))
    assert torch.isfinite(torch.addmm(nan_bias, a, b, beta=0)).all(), "beta = 0 ignores the bias, NaN included"
    bb, ba, bm = (
        torch.randn(2, 5, 6, generator=gen),
        torch.randn(2, 5, 4, generator=gen),
        torch.randn(2, 4, 6, generator=gen),
    )
    want = 0.25 * bb.double() + 3.0 * (ba.double() @ bm.double())
    assert torch.allclose(torch.baddbmm(bb, ba, bm, beta=0.25, alpha=3.0).double(), want, atol=1e-5)
    # nn.Linear reaches addmm: its output is the bias plus numpy's product
    layer = torch.nn.Linear(4, 6)
    assert torch.equal(layer(a), torch.from_numpy(a.numpy() @ layer.weight.detach().numpy().T) + layer.bias.detach())


def test_strided_operands_give_the_bits_of_their_contiguous_copies():
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(64, 80, generator=gen)
    a, b = big[::2, 5:45], big[:40, ::2].t()[:, :30]  # a row-strided slice; a transposed, strided slice
    assert not a.is_contiguous() and not b.is_contiguous()
    assert _bits(a @ b) == _bits(a.contiguous() @ b.contiguous())
    assert _bits(a @ a.t()) == _bits(a.contiguous() @ a.contiguous().t().contiguous())


def test_dtypes_and_errors():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 3, generator=gen), torch.randn(3, 2, generator=gen)
    assert torch.mm(a.bfloat16(), b.bfloat16()).dtype == torch.bfloat16
    assert torch.mm(a.double(), b.double()).dtype == torch.float64
    ints = torch.arange(12).reshape(4, 3)
    assert torch.equal(ints @ ints.t(), torch.from_numpy(ints.numpy() @ ints.numpy().T))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.mm(a, b.double())


def test_first_and_second_order_gradients_through_the_products():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(7, 6, dtype=torch.float64, generator=gen, requires_grad=True)

    def f(x, w):
        return torch.tanh(x @ w).pow(2).sum()

    assert torch.autograd.gradcheck(f, (x, w))
    assert torch.autograd.gradgradcheck(f, (x, w))
    q = torch.randn(2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda q: (q @ q.transpose(1, 2)).softmax(-1).pow(2).sum(), (q,))


_CHILD = """
import hashlib, json, torch
from meta.infra import products
g = torch.Generator().manual_seed(0)
a, b = torch.randn(700, 1100, generator=g), torch.randn(1100, 500, generator=g)
print(json.dumps({"state": products.state(), "bits": hashlib.sha256((a @ b).numpy().tobytes()).hexdigest()}))
"""


def _child(**extra: str) -> dict:
    env = {**os.environ, **PINS, "OMP_NUM_THREADS": "1", **extra}
    if "GRAM_NUMERICS" not in extra:
        env.pop("GRAM_NUMERICS", None)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bits_do_not_depend_on_threads_or_cache_size_and_fast_mode_keeps_torch():
    base = _child()
    assert base["state"]["kernel"] == products.KERNEL, "torch's start-up hook installs the products"
    assert _child(OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")["bits"] == base["bits"]
    assert _child(OPENBLAS_L2_SIZE="128")["bits"] == base["bits"]
    assert _child(OPENBLAS_L2_SIZE="65536")["bits"] == base["bits"]
    fast = _child(GRAM_NUMERICS="fast", MKL_CBWR="", OPENBLAS_CORETYPE="")
    assert fast["state"]["kernel"] == "torch"
