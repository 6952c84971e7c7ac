"""Fused LayerNorm over the last dim: Triton kernels (``layer_norm_triton``) -> launch functions
-> torch reference with the same signature -> :class:`LayerNormFunction` -> :func:`fused_layer_norm`.

Statistics (mean, rstd) are fp32; y and dx have x's dtype; dweight / dbias are fp32.
"""
from __future__ import annotations

import torch

from ._dispatch import HALF_AND_SINGLE, check_same_device, check_tensor, check_triton_float, resolve_backend

_FLOATS = HALF_AND_SINGLE + (torch.float64,)


def _triton_module():
    from . import layer_norm_triton

    return layer_norm_triton


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def layer_norm_forward_torch(x, weight, bias, eps):
    """Reference forward: x [..., N] -> (y [..., N] x.dtype, mean [...] fp32, rstd [...] fp32)."""
    xf = x.to(_stat_dtype(x))
    mean = xf.mean(-1)
    xc = xf - mean[..., None]
    rstd = torch.rsqrt((xc * xc).mean(-1) + eps)
    y = xc * rstd[..., None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype), mean, rstd


def layer_norm_backward_torch(dy, x, weight, mean, rstd):
    """Reference backward -> (dx [..., N] x.dtype, dweight [N] fp32 or None, dbias [N] fp32)."""
    ct = _stat_dtype(x)
    n = x.shape[-1]
    dyf = dy.to(ct)
    xhat = (x.to(ct) - mean[..., None].to(ct)) * rstd[..., None].to(ct)
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    c1 = (xhat * wdy).sum(-1, keepdim=True) / n
    c2 = wdy.sum(-1, keepdim=True) / n
    dx = (wdy - (xhat * c1 + c2)) * rstd[..., None].to(ct)
    dweight = (dyf * xhat).reshape(-1, n).sum(0) if weight is not None else None
    return dx.to(x.dtype), dweight, dyf.reshape(-1, n).sum(0)


def _check(op, x, weight, bias, backend):
    check_tensor(op, "x", x, dtypes=_FLOATS)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dim to normalise, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(op, name, t, ndim=1, dtypes=_FLOATS, layout="[N]")
            if t.shape[0] != n:
                raise ValueError(f"{op}: {name} has {t.shape[0]} elements but x's last dim is {n}; "
                                 f"pass a [{n}] {name} (or None)")
    check_same_device(op, x=x, weight=weight, bias=bias)
    backend = resolve_backend(backend, x.device, op)
    if backend == "triton":
        check_triton_float(op, "x", x)
        limit = _triton_module().MAX_COLS
        if n > limit:
            raise ValueError(f"{op}: last dim {n} exceeds the Triton kernel's {limit}; pass backend='torch'")
    return backend


def _contig(t):
    return None if t is None else t.contiguous()


def layer_norm_forward(x, weight=None, bias=None, eps=1e-5, backend="auto"):
    """LayerNorm over the last dim.

    Args: x [..., N]; weight, bias [N] or None; eps added to the variance.
    Returns: (y [..., N] in x's dtype, mean [...] fp32, rstd [...] fp32).
    """
    backend = _check("layer_norm_forward", x, weight, bias, backend)
    if backend == "triton":
        return _triton_module().layer_norm_forward_triton(x, _contig(weight), _contig(bias), eps)
    return layer_norm_forward_torch(x, weight, bias, eps)


def layer_norm_backward(dy, x, weight, mean, rstd, backend="auto"):
    """Gradients of :func:`layer_norm_forward`.

    Args: dy, x [..., N]; weight [N] or None; mean, rstd [...] from the forward.
    Returns: (dx [..., N] in x's dtype, dweight [N] fp32 or None when weight is None,
    dbias [N] fp32 = dy summed over leading dims).
    """
    op = "layer_norm_backward"
    backend = _check(op, x, weight, None, backend)
    check_tensor(op, "dy", dy, dtypes=_FLOATS)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy shape {tuple(dy.shape)} must equal x shape {tuple(x.shape)}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.shape != x.shape[:-1]:
            raise ValueError(f"{op}: {name} shape {tuple(t.shape)} must be x.shape[:-1] = {tuple(x.shape[:-1])}")
    if backend == "triton":
        return _triton_module().layer_norm_backward_triton(dy, x, _contig(weight), mean, rstd)
    return layer_norm_backward_torch(dy, x, weight, mean, rstd)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, backend):
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps, backend)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = layer_norm_backward(dy, x, weight, mean, rstd, ctx.backend)
        dweight = dweight.to(weight.dtype) if weight is not None else None
        dbias = dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return dx, dweight, dbias, None, None


def fused_layer_norm(x, weight=None, bias=None, eps=1e-5, backend="auto"):
    """Differentiable LayerNorm over the last dim: x [..., N], weight/bias [N] or None -> y [..., N]."""
    return LayerNormFunction.apply(x, weight, bias, eps, backend)
