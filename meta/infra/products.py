"""Pinned matrix products: ATen's CPU ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` computed by numpy's OpenBLAS.

Under the pins, oneMKL's only vendor-independent branch (``MKL_CBWR=COMPATIBLE``) runs a single-thread fp32
product at a quarter to a half of the unpinned rate, and products are most of a CLIP step.  OpenBLAS, the BLAS
numpy ships, gives the same bits on every x86-64 CPU with AVX2 and FMA once three things are fixed:

- the kernel set: ``OPENBLAS_CORETYPE=Haswell`` (already a pin, :mod:`meta.infra.numerics`) selects the same
  hand-written Haswell kernels on AVX2 and AVX-512 machines, AMD or Intel;
- the blocking: the reduction (K) block of the Haswell set is a build constant (OpenBLAS ``param.h``,
  ``SGEMM_DEFAULT_Q``; ``kernel/setparam-ref.c`` reads the L2 size only for other core types), so each output
  element is the same sum of the same FMA chains on any cache size; ``OPENBLAS_L2_SIZE`` changes nothing
  (``docs/numerics.md`` shows the probe);
- the threads: one (:data:`THREADS`), because more threads split the work differently and change the bits.

:func:`install` registers Python kernels for those ATen ops at the ``CPU`` dispatch key, below autograd, so every
dispatched product and its first- and second-order backward takes this path (convolutions and the fused CPU attention
kernel stay on oneMKL's pinned branch); fp16 / bf16 are computed in fp32 and rounded back.  torch calls
:func:`meta.infra.numerics.autoload_products` while it starts (a ``torch.backends`` entry point, ``setup.py``), so every
process with the pins uses it from its first product; ``GRAM_NUMERICS=fast`` leaves torch's own kernels.
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    import torch

THREADS = 1
KERNEL = "numpy OpenBLAS (Haswell kernels, 1 thread)"
_OPS = ("mm", "addmm", "bmm", "baddbmm")
_library = None  # the torch.library.Library holding the kernels, once installed
_error: Optional[str] = None
_usage = {"calls": 0, "seconds": 0.0, "gflop": 0.0}  # this process's products so far (:func:`usage`)
_NUMPY_DTYPES = ("float32", "float64", "complex64", "complex128", "int32", "int64")  # torch.<name>


def _blas_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[..., m, k]``) with its last two dims C- or Fortran-ordered, in a dtype numpy multiplies."""
    t = t.detach().resolve_conj().resolve_neg()
    if str(t.dtype).removeprefix("torch.") not in _NUMPY_DTYPES:
        t = t.float()
    if not (t.is_contiguous() or t.transpose(-1, -2).is_contiguous()):
        t = t.contiguous()
    return t


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``[m, k] @ [k, n]`` or ``[B, m, k] @ [B, k, n]`` through numpy, in the operands' dtype."""
    if a.dtype != b.dtype:  # ATen's message: no silent promotion
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    dtype = a.dtype
    start = time.perf_counter()
    x, y = _blas_ready(a), _blas_ready(b)
    out = x.new_empty((*x.shape[:-1], y.shape[-1]))
    np.matmul(x.numpy(), y.numpy(), out=out.numpy())
    _usage["calls"] += 1
    _usage["seconds"] += time.perf_counter() - start
    _usage["gflop"] += 2e-9 * out.numel() * x.shape[-1]
    return out if out.dtype == dtype else out.to(dtype)


def _scaled_add(product: torch.Tensor, bias: torch.Tensor, beta, alpha) -> torch.Tensor:
    """``beta * bias + alpha * product`` as ATen's ``addmm`` defines it (``beta == 0`` ignores ``bias``)."""
    if alpha != 1:
        product = product.mul_(alpha)
    if beta == 0:
        return product
    return product.add_(bias.expand_as(product), alpha=beta)


def _scaled_product(bias, a, b, *, beta=1, alpha=1):
    """ATen's ``addmm`` / ``baddbmm``: ``beta * bias + alpha * (a @ b)``."""
    return _scaled_add(_product(a, b), bias, beta, alpha)


def _one_openblas_thread() -> None:
    from threadpoolctl import ThreadpoolController

    found = ThreadpoolController().select(internal_api="openblas")
    if not found.lib_controllers:
        raise RuntimeError("numpy's OpenBLAS is not loaded (numpy built against another BLAS)")
    found.limit(limits=THREADS)


def install() -> None:
    """Route ATen's CPU ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` through numpy's OpenBLAS (idempotent)."""
    global _library
    if _library is not None:
        return
    import torch

    _one_openblas_thread()
    with warnings.catch_warnings():  # torch warns that it replaces the registered CPU kernels: that is the point
        warnings.simplefilter("ignore")
        library = torch.library.Library("aten", "IMPL")
        for name, kernel in zip(_OPS, (_product, _scaled_product, _product, _scaled_product)):
            library.impl(name, kernel, "CPU")
    _library = library


def failed(reason: str) -> None:
    """Record why :func:`install` failed at start-up (:func:`state` names it; the golden check then fails)."""
    global _error
    _error = reason


def usage() -> dict:
    """This process's dispatched products so far: ``calls``, wall ``seconds`` inside them, ``gflop`` (2·m·k·n)."""
    return dict(_usage)


def state() -> dict:
    """``{"kernel": KERNEL or "torch", "openblas": numpy's OpenBLAS build, "error": why not installed}``."""
    record = {"kernel": KERNEL if _library is not None else "torch"}
    if _library is not None:
        record["openblas"] = (
            getattr(np.__config__, "CONFIG", {}).get("Build Dependencies", {}).get("blas", {}).get("version")
        )
    if _error:
        record["error"] = _error
    return record
