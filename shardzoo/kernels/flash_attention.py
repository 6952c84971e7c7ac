"""Attention block kernel: the building block of ring attention.

Layering: Triton kernels (``flash_attention_triton``) and torch's fused CPU kernel
(``flash_attention_cpu``) -> launch functions with the same signature as the pure-torch
reference (``flash_attention_ref``) -> :func:`attention_block_forward`
/ :func:`attention_block_backward` (checks + dispatch) -> :class:`FlashAttentionFunction`
-> :func:`flash_attention`.

Contract: ``forward`` returns ``(out, lse)`` with ``lse`` the fp32 natural-log sum of
``exp(scale * q.k)`` over visible keys (``-inf`` and ``out = 0`` for a row that sees no
key). ``backward`` accepts a *global* ``lse`` (merged over several key blocks), so the
gradients of one block are its exact share of the full-attention gradients.
"""
from __future__ import annotations

import math

import torch

from . import flash_attention_cpu as _cpu
from . import flash_attention_ref as _ref
from ._dispatch import HALF_AND_SINGLE, check_same_device, check_tensor, check_triton_float, resolve_backend

_FLOATS = HALF_AND_SINGLE + (torch.float64,)
ATTENTION_BACKENDS = ("auto", "triton", "aten", "torch")


def _resolve_attention_backend(backend, device, op) -> str:
    """"auto": Triton for CUDA tensors, torch's fused CPU flash kernel ("aten") for CPU tensors
    where this torch has it, else the pure-torch reference ("torch")."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {ATTENTION_BACKENDS}; pass 'auto' or one of "
                         "the others")
    if backend == "aten":
        if device.type != "cpu" or not _cpu.available():
            raise ValueError(f"{op}: backend='aten' runs CPU tensors with torch's CPU flash attention ops; got "
                             f"{device.type} tensors (ops available: {_cpu.available()}). Pass backend='auto'")
        return "aten"
    resolved = resolve_backend(backend, device, op)
    if backend == "auto" and resolved == "torch" and device.type == "cpu" and _cpu.available():
        return "aten"
    return resolved


def _triton_module():
    from . import flash_attention_triton

    return flash_attention_triton


def _check_inputs(op, q, k, v, key_padding_mask, softmax_scale, backend):
    """Validate shapes / dtypes and return (backend, softmax_scale)."""
    for name, t, layout in (("q", q, "[B, H, Sq, D]"), ("k", k, "[B, H, Sk, D]"), ("v", v, "[B, H, Sk, D]")):
        check_tensor(op, name, t, ndim=4, dtypes=_FLOATS, layout=layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape [B, H, Sk, D], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, heads and head_dim "
                         "([B, H, Sq, D] vs [B, H, Sk, D]); repeat k/v heads for grouped-query attention")
    if key_padding_mask is not None:
        check_tensor(op, "key_padding_mask", key_padding_mask, dtypes=(torch.bool,))
        if tuple(key_padding_mask.shape) != (b, k.shape[2]):
            raise ValueError(f"{op}: key_padding_mask shape {tuple(key_padding_mask.shape)} must be [B, Sk] = "
                             f"{(b, k.shape[2])} (True = attend)")
    check_same_device(op, q=q, k=k, v=v, key_padding_mask=key_padding_mask)
    backend = _resolve_attention_backend(backend, q.device, op)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    softmax_scale = float(softmax_scale)
    if backend == "triton":
        check_triton_float(op, "q", q)
        tri = _triton_module()
        if not tri.MIN_HEAD_DIM <= d <= tri.MAX_HEAD_DIM:
            raise ValueError(f"{op}: head_dim={d} is outside {tri.MIN_HEAD_DIM}..{tri.MAX_HEAD_DIM} supported by the "
                             "Triton kernel; pass backend='torch' or split the head dim")
    return backend, softmax_scale


def attention_block_forward(q, k, v, *, causal=False, key_padding_mask=None, softmax_scale=None, backend="auto"):
    """Attention of one query block against one key block.

    Args:
        q: [B, H, Sq, D]; k, v: [B, H, Sk, D]; fp32 / fp16 / bf16 (one dtype).
        causal: query i sees key j iff j <= i (top-left aligned, like SDPA ``is_causal``).
        key_padding_mask: optional bool [B, Sk], True = attend.
        softmax_scale: defaults to 1 / sqrt(D).
        backend: "auto" (Triton for CUDA; torch's fused CPU flash kernel for CPU, when this
            torch has it), "triton", "aten" (CPU) or "torch" (the pure-torch reference).

    Returns:
        out [B, H, Sq, D] in q's dtype (accumulated in fp32) and lse [B, H, Sq] fp32.
        Rows without a visible key have lse = -inf and out = 0.
    """
    op = "attention_block_forward"
    backend, scale = _check_inputs(op, q, k, v, key_padding_mask, softmax_scale, backend)
    if backend == "triton":
        return _triton_module().attention_forward_triton(q, k, v, causal, key_padding_mask, scale)
    if backend == "aten":
        return _cpu.attention_forward_aten(q, k, v, causal, key_padding_mask, scale)
    return _ref.attention_forward_torch(q, k, v, causal, key_padding_mask, scale)


def attention_block_backward(dout, q, k, v, out, lse, *, causal=False, key_padding_mask=None, softmax_scale=None,
                             backend="auto"):
    """Gradients of one attention block given a (possibly global) lse.

    Args:
        dout, out: [B, H, Sq, D] (out is the final, merged attention output when lse is global).
        q: [B, H, Sq, D]; k, v: [B, H, Sk, D]; lse: [B, H, Sq].
        Other arguments as in :func:`attention_block_forward`.

    Returns:
        (dq [B, H, Sq, D], dk [B, H, Sk, D], dv [B, H, Sk, D]), all fp32, computed with
        P = exp(scale * q.k - lse), D_i = rowsum(dout * out), dS = P * (dP - D).
    """
    op = "attention_block_backward"
    backend, scale = _check_inputs(op, q, k, v, key_padding_mask, softmax_scale, backend)
    for name, t in (("dout", dout), ("out", out)):
        check_tensor(op, name, t, dtypes=_FLOATS)
        if t.shape != q.shape:
            raise ValueError(f"{op}: {name} shape {tuple(t.shape)} must equal q's shape {tuple(q.shape)}")
    check_tensor(op, "lse", lse, dtypes=_FLOATS)
    if lse.shape != q.shape[:3]:
        raise ValueError(f"{op}: lse shape {tuple(lse.shape)} must be [B, H, Sq] = {tuple(q.shape[:3])}")
    check_same_device(op, q=q, dout=dout, out=out, lse=lse)
    if backend == "triton":
        return _triton_module().attention_backward_triton(dout, q, k, v, out, lse, causal, key_padding_mask, scale)
    if backend == "aten":
        return _cpu.attention_backward_aten(dout, q, k, v, out, lse, causal, key_padding_mask, scale)
    return _ref.attention_backward_torch(dout, q, k, v, out, lse, causal, key_padding_mask, scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Differentiable single-block attention; returns ``out`` only (lse stays internal)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, key_padding_mask, softmax_scale, backend):
        out, lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                           softmax_scale=softmax_scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.settings = (causal, softmax_scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        causal, softmax_scale, backend = ctx.settings
        dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, causal=causal,
                                              key_padding_mask=key_padding_mask, softmax_scale=softmax_scale,
                                              backend=backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def flash_attention(q, k, v, *, causal=False, key_padding_mask=None, softmax_scale=None, backend="auto"):
    """Memory-efficient attention, differentiable in q, k, v.

    q [B, H, Sq, D], k/v [B, H, Sk, D] -> out [B, H, Sq, D] in q's dtype. Arguments as in
    :func:`attention_block_forward`.
    """
    return FlashAttentionFunction.apply(q, k, v, causal, key_padding_mask, softmax_scale, backend)
