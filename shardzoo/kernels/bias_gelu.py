"""Fused gelu(x + bias): Triton kernels (``bias_gelu_triton``) -> launch functions -> torch
reference with the same signature -> :class:`BiasGeluFunction` -> :func:`bias_gelu`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import HALF_AND_SINGLE, check_same_device, check_tensor, check_triton_float, resolve_backend

_FLOATS = HALF_AND_SINGLE + (torch.float64,)
_APPROXIMATIONS = ("none", "tanh")


def _triton_module():
    from . import bias_gelu_triton

    return bias_gelu_triton


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def bias_gelu_forward_torch(x, bias, approximate):
    """Reference: x [..., N], bias [N] or None -> gelu(x + bias) in x's dtype (fp32 math)."""
    h = x.to(_compute_dtype(x))
    if bias is not None:
        h = h + bias.to(h.dtype)
    return F.gelu(h, approximate=approximate).to(x.dtype)


def bias_gelu_backward_torch(dy, x, bias, approximate):
    """Reference backward -> (dx [..., N] in x's dtype, dbias [N] fp32 or None)."""
    ct = _compute_dtype(x)
    h = x.to(ct)
    if bias is not None:
        h = h + bias.to(ct)
    if approximate == "tanh":
        c = 0.7978845608028654
        t = torch.tanh(c * (h + 0.044715 * h ** 3))
        grad = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)
    else:
        grad = 0.5 * (1 + torch.erf(h * 0.7071067811865476)) + h * torch.exp(-0.5 * h * h) * 0.3989422804014327
    dx = (dy.to(ct) * grad).to(x.dtype)
    dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=ct) if bias is not None else None
    return dx, dbias


def _check(op, x, bias, approximate, backend):
    check_tensor(op, "x", x, dtypes=_FLOATS)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim, got a scalar")
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"{op}: approximate={approximate!r} is not one of {_APPROXIMATIONS}; pass 'none' or 'tanh'")
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=_FLOATS, layout="[N]")
        if bias.shape[0] != x.shape[-1]:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements but x's last dim is {x.shape[-1]}; "
                             f"pass a [{x.shape[-1]}] bias (or None)")
    check_same_device(op, x=x, bias=bias)
    backend = resolve_backend(backend, x.device, op)
    if backend == "triton":
        check_triton_float(op, "x", x)
    return backend


def bias_gelu_forward(x, bias, approximate="none", backend="auto"):
    """gelu(x + bias). x [..., N], bias [N] or None -> y [..., N] in x's dtype."""
    backend = _check("bias_gelu_forward", x, bias, approximate, backend)
    if backend == "triton":
        return _triton_module().bias_gelu_forward_triton(x, None if bias is None else bias.contiguous(), approximate)
    return bias_gelu_forward_torch(x, bias, approximate)


def bias_gelu_backward(dy, x, bias, approximate="none", backend="auto"):
    """Gradients of :func:`bias_gelu_forward` -> (dx [..., N] x.dtype, dbias [N] fp32 or None)."""
    op = "bias_gelu_backward"
    backend = _check(op, x, bias, approximate, backend)
    check_tensor(op, "dy", dy, dtypes=_FLOATS)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy shape {tuple(dy.shape)} must equal x shape {tuple(x.shape)}")
    if backend == "triton":
        return _triton_module().bias_gelu_backward_triton(dy, x, None if bias is None else bias.contiguous(),
                                                          approximate)
    return bias_gelu_backward_torch(dy, x, bias, approximate)


class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate, backend):
        ctx.save_for_backward(x, bias)
        ctx.settings = (approximate, backend)
        return bias_gelu_forward(x, bias, approximate, backend)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        approximate, backend = ctx.settings
        dx, dbias = bias_gelu_backward(dy, x, bias, approximate, backend)
        return dx, (dbias.to(bias.dtype) if bias is not None else None), None, None


def bias_gelu(x, bias=None, approximate="none", backend="auto"):
    """Differentiable gelu(x + bias): x [..., N], bias [N] or None -> [..., N] in x's dtype."""
    return BiasGeluFunction.apply(x, bias, approximate, backend)
