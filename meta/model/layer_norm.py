"""LayerNorm with a closed-form double backward, for the second-order support pass (``META.CLOSED_FORM_LAYER_NORM``).

Autograd differentiates every LayerNorm's backward again with PyTorch's general ``layer_norm_double_backward``
(~70 whole-tensor operators): on the ViT-B/16 VPT step the largest item of the memory traffic, 97 of 447 GB
(``python -m gram_tools.step_traffic``).

Here the LayerNorm's backward is itself a function with a hand-derived backward.  Per row of width N, with the
saved mean and ``r = rstd``, ``x̂ = (x - mean) r``, ``h = w ⊙ g`` (``g`` the output gradient, ``w`` the frozen
weight) and ``P(u) = u - mean(u) - x̂ mean(u ⊙ x̂)``, the backward is ``gx = r P(h)``.  For an incoming gradient
``v`` of ``gx``, ``S = <v, gx>``:

* ``∂S/∂g = w ⊙ r P(v)``  (``P`` is symmetric);
* ``∂S/∂x = -r² [ (mean(v ⊙ h) - mean(v) mean(h) - c_v c_h) x̂ + c_h P(v) + c_v P(h) ]``, with
  ``c_v = mean(v ⊙ x̂)``, ``c_h = mean(h ⊙ x̂)`` (from ``∂r/∂x = -r² x̂ / N`` and ``∂<u, x̂>/∂x = r P(u)``).

Five row reductions and ~50 whole-tensor reads and writes instead of ~90.  The forward and first backward are
PyTorch's own kernels (loss and first gradient bit-identical); the meta-gradient equals autograd's to rounding
(``tests/test_layer_norm_grads.py``).  Only frozen affine LayerNorms over the last dimension take this path; the
double backward is not differentiable again.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch
from torch import nn

_ACTIVE = contextvars.ContextVar("closed_form_layer_norm", default=False)


@contextlib.contextmanager
def closed_form_layer_norm(enabled: bool = True) -> Iterator[None]:
    """LayerNorms run by :func:`apply_norm` inside this context use the closed-form double backward (when
    ``enabled``); the graph they build keeps it after the context ends."""
    token = _ACTIVE.set(bool(enabled))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _LayerNormBackward(torch.autograd.Function):
    """``gx`` of a LayerNorm over the last dim from ``g``, with :func:`_double_backward` as its backward."""

    @staticmethod
    def forward(ctx, g, x, weight, mean, rstd):
        shape = (x.shape[-1],)
        gx, _, _ = torch.ops.aten.native_layer_norm_backward(
            g, x, shape, mean, rstd, weight, None, [True, False, False]
        )
        ctx.save_for_backward(g, x, weight, mean, rstd)
        return gx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, v):
        g, x, weight, mean, rstd = ctx.saved_tensors
        dg, dx = _double_backward(v, g, x, weight, mean, rstd)
        return dg, dx, None, None, None


def _double_backward(
    v: torch.Tensor, g: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(∂<v, gx>/∂g, ∂<v, gx>/∂x)`` (module docstring): ``v``, ``g``, ``x`` ``[..., N]``; ``mean``, ``rstd``
    ``[..., 1]``; ``weight`` ``[N]`` or ``None``."""
    xhat = (x - mean).mul_(rstd)
    h = g if weight is None else g * weight
    mean_v, mean_h = v.mean(-1, keepdim=True), h.mean(-1, keepdim=True)
    c_v, c_h = (v * xhat).mean(-1, keepdim=True), (h * xhat).mean(-1, keepdim=True)
    coef = (v * h).mean(-1, keepdim=True) - mean_v * mean_h - c_v * c_h
    p_v = torch.addcmul(v - mean_v, xhat, c_v, value=-1.0)
    p_h = torch.addcmul(h - mean_h, xhat, c_h, value=-1.0)
    dx = torch.addcmul(p_h.mul_(c_v), p_v, c_h).addcmul_(xhat, coef).mul_(-(rstd * rstd))
    dg = p_v.mul_(rstd) if weight is None else p_v.mul_(rstd).mul_(weight)
    return dg, dx


class _LayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim with a frozen (or no) affine weight; backward through :class:`_LayerNormBackward`."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, mean, rstd = ctx.saved_tensors
        return _LayerNormBackward.apply(g, x, weight, mean, rstd), None, None, None


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """``F.layer_norm(x, x.shape[-1:], weight, bias, eps)`` with the closed-form double backward; ``weight`` and
    ``bias`` (``[N]`` or ``None``) get no gradient.  Computes in ``x``'s dtype."""
    return _LayerNorm.apply(x, weight, bias, eps)


def _takes_closed_form(ln: nn.Module) -> bool:
    from open_clip.transformer import LayerNorm, LayerNormFp32

    return (
        type(ln) in (LayerNorm, LayerNormFp32)
        and len(ln.normalized_shape) == 1
        and not any(p.requires_grad for p in ln.parameters())
    )


def closed_form_active(ln: nn.Module) -> bool:
    """Whether :func:`apply_norm` runs ``ln`` in closed form here (inside the context, an open_clip LayerNorm)."""
    return _ACTIVE.get() and _takes_closed_form(ln)


def apply_norm(ln: nn.Module, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``ln(x)``, or inside :func:`closed_form_layer_norm` the same LayerNorm through :func:`layer_norm`.

    The closed form computes as open_clip's norm would on CUDA: in float32 for ``LayerNormFp32``, under autocast
    (autocast's float32 policy for ``layer_norm``) or with float32 weights (PyTorch's mixed-dtype kernel computes
    in float32), else in ``x``'s dtype; the result is cast to ``out_dtype``
    (default ``x``'s dtype, as open_clip's ``LayerNorm`` and ``LayerNormFp32`` return).  ``out_dtype`` without the
    closed form: ``ln(x)`` cast to it."""
    if not closed_form_active(ln):
        y = ln(x)
        return y if out_dtype is None else y.to(out_dtype)
    from open_clip.transformer import LayerNormFp32

    device_type = x.device.type
    weight_fp32 = ln.weight is not None and ln.weight.dtype == torch.float32
    upcast = isinstance(ln, LayerNormFp32) or torch.is_autocast_enabled(device_type) or weight_fp32
    compute = torch.float32 if upcast and x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    with torch.autocast(device_type=device_type, enabled=False):
        weight = None if ln.weight is None else ln.weight.to(compute)
        bias = None if ln.bias is None else ln.bias.to(compute)
        y = layer_norm(x.to(compute), weight, bias, ln.eps)
    return y.to(out_dtype or x.dtype)
