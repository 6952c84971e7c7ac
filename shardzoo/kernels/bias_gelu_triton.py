"""Triton kernels for gelu(x + bias): elementwise forward and backward (fp32 math)."""
from __future__ import annotations

import torch

from ._triton import cdiv, jit, tl

_BLOCK_GPU, _BLOCK_INTERPRETER = 2048, 1024


@jit
def _bias_gelu_fwd_kernel(X, Bias, Y, numel, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(Bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))  # tanh(u) from exp of a non-positive value: no overflow
        t = tl.where(u >= 0, (1.0 - e) / (1.0 + e), (e - 1.0) / (1.0 + e))
        y = 0.5 * x * (1.0 + t)
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _bias_gelu_bwd_kernel(DY, X, Bias, DX, numel, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(Bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))
        t = tl.where(u >= 0, (1.0 - e) / (1.0 + e), (e - 1.0) / (1.0 + e))
        du = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        grad = cdf + x * pdf
    tl.store(DX + offs, (dy * grad).to(DX.dtype.element_ty), mask=mask)


def _block(x: torch.Tensor) -> int:
    return _BLOCK_GPU if x.device.type == "cuda" else _BLOCK_INTERPRETER


def bias_gelu_forward_triton(x, bias, approximate):
    """x [..., N], bias [N] or None -> gelu(x + bias) [..., N] in x's dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    numel = x.numel()
    if numel:
        block = _block(x)
        _bias_gelu_fwd_kernel[(cdiv(numel, block),)](
            x, bias if bias is not None else x, y, numel, x.shape[-1],
            HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=block, num_warps=8)
    return y


def bias_gelu_backward_triton(dy, x, bias, approximate):
    """-> (dx [..., N] in x's dtype, dbias [N] fp32 or None)."""
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    numel = x.numel()
    if numel:
        block = _block(x)
        _bias_gelu_bwd_kernel[(cdiv(numel, block),)](
            dy, x, bias if bias is not None else x, dx, numel, x.shape[-1],
            HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=block, num_warps=8)
    dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32) if bias is not None else None
    return dx, dbias
