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

Dropout on the probabilities (``dropout_p > 0``) happens inside the kernel with the stateless
mask of :mod:`.dropout_mask`, a hash of (seed, global batch index, global head, global query
position, global key position): ``lse`` stays the undropped normaliser (blocks merge as without
dropout) and ``out = (P * Z / (1-p)) V``; backward redraws the same mask from the same seed.
torch's fused CPU op cannot take a given mask, so "auto" runs CPU tensors with dropout on the
torch reference.

A sliding window (``window``, transformers' ``sliding_window``) masks by global positions: query
at ``q_positions[i]`` sees the keys at ``k_positions[j] > q_positions[i] - window`` (with
``causal``, also j <= i on the local indices). The reference applies it per chunk, the CPU
fused op as an additive mask; the Triton kernel has no window, so "auto" runs a windowed call
on CUDA tensors on the torch reference (ring attention passes a window only to the blocks the
window cuts; blocks wholly inside it run unmasked, blocks wholly outside are not computed).
"""
from __future__ import annotations

import math

import torch

from . import flash_attention_cpu as _cpu
from . import flash_attention_ref as _ref
from .flash_attention_ref import Band
from .dropout_mask import dropout_keys
from ._dispatch import HALF_AND_SINGLE, check_same_device, check_tensor, check_triton_float, resolve_backend

_FLOATS = HALF_AND_SINGLE + (torch.float64,)
ATTENTION_BACKENDS = ("auto", "triton", "aten", "torch")


def _resolve_attention_backend(backend, device, op, dropout=False, needs_delta=False, window=False) -> str:
    """"auto": Triton for CUDA tensors (the torch reference with a ``window``), torch's fused CPU
    flash kernel ("aten") for CPU tensors where this torch has it and there is no dropout (nor an
    lse gradient, ``needs_delta``), else the pure-torch reference ("torch")."""
    resolved = _resolve_unwindowed(backend, device, op, dropout, needs_delta)
    if window and resolved == "triton":
        if backend == "triton":
            raise ValueError(f"{op}: backend='triton' has no sliding window; pass backend='auto' (the torch "
                             "reference runs windowed blocks) or window=None")
        return "torch"
    return resolved


def _resolve_unwindowed(backend, device, op, dropout, needs_delta) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {ATTENTION_BACKENDS}; pass 'auto' or one of "
                         "the others")
    if backend == "aten":
        if device.type != "cpu" or not _cpu.available():
            raise ValueError(f"{op}: backend='aten' runs CPU tensors with torch's CPU flash attention ops; got "
                             f"{device.type} tensors (ops available: {_cpu.available()}). Pass backend='auto'")
        if dropout:
            raise ValueError(f"{op}: backend='aten' (torch's fused CPU flash kernel) cannot apply the stateless "
                             "dropout mask, so dropout_p must be 0 there; pass backend='auto' or 'torch' for "
                             "dropout on CPU")
        if needs_delta:
            raise ValueError(f"{op}: backend='aten' (torch's fused CPU flash kernel) computes D = rowsum(dO * O) "
                             "itself and cannot take an lse gradient; pass backend='auto' or 'torch'")
        return "aten"
    resolved = resolve_backend(backend, device, op)
    if backend == "auto" and resolved == "torch" and device.type == "cpu" and _cpu.available() and not (
            dropout or needs_delta):
        return "aten"
    return resolved


def _triton_module():
    from . import flash_attention_triton

    return flash_attention_triton


def _check_inputs(op, q, k, v, key_padding_mask, softmax_scale, backend, dropout=False, needs_delta=False,
                  window=False):
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
    backend = _resolve_attention_backend(backend, q.device, op, dropout, needs_delta, window)
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


def _positions(op, name, positions, length, device):
    if positions is None:
        return torch.arange(length, device=device)
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != (length,):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions)
        raise ValueError(f"{op}: {name} must be an int64 tensor [{length}] of global sequence positions, got {got}; "
                         f"e.g. torch.arange(start, start + {length})")
    if positions.device != device:
        raise ValueError(f"{op}: {name} is on {positions.device} but q is on {device}; move it to q's device")
    return positions


def _check_dropout_p(op, dropout_p) -> bool:
    """True when there is dropout to apply."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p={dropout_p!r} must be a float in [0, 1); pass 0.0 for no dropout")
    return dropout_p > 0.0


def _window(op, q, k, window, q_positions, k_positions):
    """Validate the sliding window -> a Band, or None without one."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{op}: window={window!r} must be an int >= 1 (query at position p sees the keys at "
                         "positions > p - window), or None for no sliding window")
    return Band(window, _positions(op, "q_positions", q_positions, q.shape[2], q.device),
                _positions(op, "k_positions", k_positions, k.shape[2], q.device))


def _dropout(op, q, k, dropout_p, dropout_seed, q_positions, k_positions, head_offset, batch_offset):
    """Validate the dropout arguments -> DropoutKeys, or None without dropout."""
    if not dropout_p:
        return None
    if not isinstance(dropout_seed, int):
        raise ValueError(f"{op}: dropout_p={dropout_p} needs dropout_seed, a Python int that forward and backward "
                         f"share (got {dropout_seed!r}); draw one e.g. with torch.randint(2**62, ()).item()")
    for name, value in (("head_offset", head_offset), ("batch_offset", batch_offset)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{op}: {name}={value!r} must be a non-negative int (the global index of this "
                             "block's first head / batch row)")
    qp = _positions(op, "q_positions", q_positions, q.shape[2], q.device)
    kp = _positions(op, "k_positions", k_positions, k.shape[2], q.device)
    return dropout_keys(float(dropout_p), dropout_seed, q.shape[0], q.shape[1], qp, kp, batch_offset=batch_offset,
                        head_offset=head_offset)


def attention_block_forward(q, k, v, *, causal=False, key_padding_mask=None, softmax_scale=None, backend="auto",
                            dropout_p=0.0, dropout_seed=None, q_positions=None, k_positions=None, head_offset=0,
                            batch_offset=0, window=None):
    """Attention of one query block against one key block.

    Args:
        q: [B, H, Sq, D]; k, v: [B, H, Sk, D]; fp32 / fp16 / bf16 (one dtype).
        causal: query i sees key j iff j <= i (top-left aligned, like SDPA ``is_causal``).
        key_padding_mask: optional bool [B, Sk], True = attend.
        softmax_scale: defaults to 1 / sqrt(D).
        backend: "auto" (Triton for CUDA; torch's fused CPU flash kernel for CPU, when this
            torch has it and dropout_p is 0, else the reference), "triton", "aten" (CPU, no
            dropout) or "torch" (the pure-torch reference).
        dropout_p: drop probability of the attention probabilities, in [0, 1).
        dropout_seed: Python int, required when dropout_p > 0; pass the same to the backward.
        q_positions: int64 [Sq], k_positions: int64 [Sk]: global sequence positions of the
            query rows / key columns (default arange); they select the dropout mask and the
            window (``causal`` stays top-left aligned on the local indices).
        head_offset, batch_offset: global index of this block's first head / batch row.
        window: optional int >= 1, a sliding window: query at position p sees only the keys at
            positions > p - window (transformers' ``sliding_window``); Triton has none, so
            "auto" runs CUDA tensors on the reference then.

    Returns:
        out [B, H, Sq, D] in q's dtype (accumulated in fp32) and lse [B, H, Sq] fp32, the
        undropped softmax normaliser. Rows without a visible key have lse = -inf and out = 0.
    """
    op = "attention_block_forward"
    backend, scale = _check_inputs(op, q, k, v, key_padding_mask, softmax_scale, backend,
                                   _check_dropout_p(op, dropout_p), window=window is not None)
    drop = _dropout(op, q, k, dropout_p, dropout_seed, q_positions, k_positions, head_offset, batch_offset)
    band = _window(op, q, k, window, q_positions, k_positions)
    extra = {} if band is None else dict(window=band)
    if backend == "triton":
        return _triton_module().attention_forward_triton(q, k, v, causal, key_padding_mask, scale, drop)
    if backend == "aten":
        return _cpu.attention_forward_aten(q, k, v, causal, key_padding_mask, scale, **extra)
    return _ref.attention_forward_torch(q, k, v, causal, key_padding_mask, scale, drop, **extra)


def attention_block_backward(dout, q, k, v, out, lse, *, causal=False, key_padding_mask=None, softmax_scale=None,
                             backend="auto", dropout_p=0.0, dropout_seed=None, q_positions=None, k_positions=None,
                             head_offset=0, batch_offset=0, lse_grad=None, window=None):
    """Gradients of one attention block given a (possibly global) lse.

    Args:
        dout, out: [B, H, Sq, D] (out is the final, merged attention output when lse is global).
        q: [B, H, Sq, D]; k, v: [B, H, Sk, D]; lse: [B, H, Sq].
        Other arguments as in :func:`attention_block_forward` (the dropout ones equal to the
        forward's, so the same mask Z is redrawn).
        lse_grad: optional [B, H, Sq], the gradient reaching the (global) lse; since
            d lse_i / d s_ij = P_ij it enters as D_i - lse_grad_i. torch's fused CPU op computes
            D itself, so "auto" runs CPU tensors with an lse gradient on the torch reference.

    Returns:
        (dq [B, H, Sq, D], dk [B, H, Sk, D], dv [B, H, Sk, D]), all fp32, computed with
        P = exp(scale * q.k - lse), D_i = rowsum(dout * out), dS = P * (dP - D), where with
        dropout dV = (P Z / (1-p))^T dout and dP = (dout V^T) Z / (1-p).
    """
    op = "attention_block_backward"
    backend, scale = _check_inputs(op, q, k, v, key_padding_mask, softmax_scale, backend,
                                   _check_dropout_p(op, dropout_p), needs_delta=lse_grad is not None,
                                   window=window is not None)
    drop = _dropout(op, q, k, dropout_p, dropout_seed, q_positions, k_positions, head_offset, batch_offset)
    band = _window(op, q, k, window, q_positions, k_positions)
    extra = {} if band is None else dict(window=band)
    for name, t in (("dout", dout), ("out", out)):
        check_tensor(op, name, t, dtypes=_FLOATS)
        if t.shape != q.shape:
            raise ValueError(f"{op}: {name} shape {tuple(t.shape)} must equal q's shape {tuple(q.shape)}")
    check_tensor(op, "lse", lse, dtypes=_FLOATS)
    if lse.shape != q.shape[:3]:
        raise ValueError(f"{op}: lse shape {tuple(lse.shape)} must be [B, H, Sq] = {tuple(q.shape[:3])}")
    check_same_device(op, q=q, dout=dout, out=out, lse=lse)
    if lse_grad is not None and lse_grad.shape != lse.shape:
        raise ValueError(f"{op}: lse_grad shape {tuple(lse_grad.shape)} must equal lse's {tuple(lse.shape)}")
    if backend == "triton":
        return _triton_module().attention_backward_triton(dout, q, k, v, out, lse, causal, key_padding_mask, scale,
                                                          drop, lse_grad)
    if backend == "aten":
        return _cpu.attention_backward_aten(dout, q, k, v, out, lse, causal, key_padding_mask, scale, **extra)
    return _ref.attention_backward_torch(dout, q, k, v, out, lse, causal, key_padding_mask, scale, drop, lse_grad,
                                         **extra)


class FlashAttentionFunction(torch.autograd.Function):
    """Differentiable single-block attention; returns ``out`` only (lse stays internal).
    ``options``: the keyword arguments of :func:`attention_block_forward` other than the mask."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, options):
        out, lse = attention_block_forward(q, k, v, key_padding_mask=key_padding_mask, **options)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, key_padding_mask=key_padding_mask,
                                              **ctx.options)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def draw_dropout_seed() -> int:
    """A seed for the dropout mask from torch's default (CPU) generator: the same on every rank
    that seeded torch alike, and restored with torch's RNG state by activation checkpointing."""
    return int(torch.randint(2 ** 62, ()).item())


def flash_attention(q, k, v, *, causal=False, key_padding_mask=None, softmax_scale=None, backend="auto",
                    dropout_p=0.0, dropout_seed=None, q_positions=None, k_positions=None, head_offset=0,
                    batch_offset=0, window=None):
    """Memory-efficient attention, differentiable in q, k, v.

    q [B, H, Sq, D], k/v [B, H, Sk, D] -> out [B, H, Sq, D] in q's dtype. Arguments as in
    :func:`attention_block_forward`; with ``dropout_p > 0`` and no ``dropout_seed`` the seed
    is drawn by :func:`draw_dropout_seed`.
    """
    if dropout_p and dropout_seed is None:
        dropout_seed = draw_dropout_seed()
    options = dict(causal=causal, softmax_scale=softmax_scale, backend=backend, dropout_p=dropout_p,
                   dropout_seed=dropout_seed, q_positions=q_positions, k_positions=k_positions,
                   head_offset=head_offset, batch_offset=batch_offset, window=window)
    return FlashAttentionFunction.apply(q, k, v, key_padding_mask, options)
