"""Triton flash-attention block kernels (forward, FA2 backward) and their launch functions.

Shapes: q [B, H, Sq, D], k/v [B, H, Sk, D]; lse [B, H, Sq] fp32. Scores are kept in
log2 units (scale * log2(e) folded in) so the kernels use exp2. head_dim is padded to
a power of two with masks. Only imported when Triton is installed.

Dropout (``HAS_DROPOUT``): the launcher passes the 32-bit row keys [B, H, Sq] and column keys
[Sk] of ``dropout_mask`` as int32; ``_dropout_kept`` forms ``fmix32(row_key + col_key)`` per
score in uint32, the same arithmetic as ``dropout_mask.keep_mask``.
"""
from __future__ import annotations

import torch

from ._triton import cdiv, jit, jit_device, next_power_of_2, tl
from .dropout_mask import as_int32

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
_LOG2E = 1.4426950408889634


@jit_device
def _dropout_kept(row_key, col_key, threshold):
    """Keep-mask of broadcastable uint32 row / column keys: (fmix32(row + col) >> 1) >= threshold."""
    h = row_key + col_key
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return (h >> 1).to(tl.int32) >= threshold


@jit
def _attn_fwd_kernel(
    Q, K, V, KPM, RK, CK, Out, Lse,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, smb,
    H, Sq, Sk, D, qk_scale, drop_threshold, drop_scale,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Sq
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter computes low-precision dots wrongly; fp32 is exact everywhere
        q = q.to(tl.float32)
    if HAS_DROPOUT:
        rk = tl.load(RK + pid_bh * Sq + offs_m, mask=m_ok, other=0).to(tl.uint32, bitcast=True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end_n = Sk
    if CAUSAL:  # key blocks past the last query of this block are fully masked
        end_n = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Sk
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = n_ok[None, :] & m_ok[:, None]
        if HAS_KPM:
            keep = tl.load(KPM + b * smb + offs_n, mask=n_ok, other=0)
            visible = visible & (keep != 0)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: avoid inf - inf
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)  # the undropped normaliser: lse merges as without dropout
        if HAS_DROPOUT:
            ck = tl.load(CK + offs_n, mask=n_ok, other=0).to(tl.uint32, bitcast=True)
            p = tl.where(_dropout_kept(rk[:, None], ck[None, :], drop_threshold), p, 0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (drop_scale / l_safe[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(Lse + pid_bh * Sq + offs_m, lse, mask=m_ok)


@jit
def _attn_bwd_delta_kernel(
    Out, DO, Delta, sob, soh, som, sod, sdb, sdh, sdm, sdd, H, Sq, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < Sq)[:, None] & (offs_d < D)[None, :]
    o = tl.load(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh * Sq + offs_m, delta, mask=offs_m < Sq)


@jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, KPM, RK, CK, DO, Lse, Delta, DK, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd, smb,
    H, Sq, Sk, D, qk_scale, sm_scale, drop_threshold, drop_scale,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per key block; loops over query blocks, accumulating dK, dV in fp32
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Sk
    d_ok = offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    key_ok = n_ok
    if HAS_KPM:
        key_ok = key_ok & (tl.load(KPM + b * smb + offs_n, mask=n_ok, other=0) != 0)
    if HAS_DROPOUT:
        ck = tl.load(CK + offs_n, mask=n_ok, other=0).to(tl.uint32, bitcast=True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start_m = 0
    if CAUSAL:  # queries before this key block cannot see it
        start_m = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for s_m in range(start_m, Sq, BLOCK_M):
        offs_m = s_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Sq
        qd_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=qd_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(Lse + pid_bh * Sq + offs_m, mask=m_ok, other=float("-inf"))
        delta = tl.load(Delta + pid_bh * Sq + offs_m, mask=m_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        visible = key_ok[:, None] & (lse != float("-inf"))[None, :]
        if CAUSAL:
            visible = visible & (offs_n[:, None] <= offs_m[None, :])
        p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        pd_t = p_t
        if HAS_DROPOUT:  # dV = (P Z / (1-p))^T dO, dP = (dO V^T) Z / (1-p)
            rk = tl.load(RK + pid_bh * Sq + offs_m, mask=m_ok, other=0).to(tl.uint32, bitcast=True)
            kept = _dropout_kept(ck[:, None], rk[None, :], drop_threshold)
            pd_t = tl.where(kept, p_t * drop_scale, 0.0)
            dp_t = tl.where(kept, dp_t * drop_scale, 0.0)
        dv += tl.dot(pd_t.to(do.dtype), do, input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    dk = dk * sm_scale
    # dK and dV are contiguous fp32 with k's shape
    out_off = pid_bh * Sk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out_off, dk, mask=kv_mask)
    tl.store(DV + out_off, dv, mask=kv_mask)


@jit
def _attn_bwd_dq_kernel(
    Q, K, V, KPM, RK, CK, DO, Lse, Delta, DQ,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd, smb,
    H, Sq, Sk, D, qk_scale, sm_scale, drop_threshold, drop_scale,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per query block; loops over key blocks (no atomics)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Sq
    d_ok = offs_d < D
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=qd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + pid_bh * Sq + offs_m, mask=m_ok, other=float("-inf"))
    delta = tl.load(Delta + pid_bh * Sq + offs_m, mask=m_ok, other=0.0)
    row_ok = lse != float("-inf")
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    if HAS_DROPOUT:
        rk = tl.load(RK + pid_bh * Sq + offs_m, mask=m_ok, other=0).to(tl.uint32, bitcast=True)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end_n = Sk
    if CAUSAL:
        end_n = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Sk
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        visible = row_ok[:, None] & n_ok[None, :]
        if HAS_KPM:
            keep = tl.load(KPM + b * smb + offs_n, mask=n_ok, other=0)
            visible = visible & (keep != 0)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if HAS_DROPOUT:  # dP = (dO V^T) Z / (1-p)
            ck = tl.load(CK + offs_n, mask=n_ok, other=0).to(tl.uint32, bitcast=True)
            dp = tl.where(_dropout_kept(rk[:, None], ck[None, :], drop_threshold), dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + pid_bh * Sq * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=qd_mask)


def _configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes by a simple rule (no autotune). Returns launch settings per pass."""
    block_d = max(16, next_power_of_2(head_dim))
    if device.type != "cuda":
        # interpreter: small, unequal tiles so small test shapes cross several block edges
        tiles = {"fwd": (32, 16, 1, 1), "dkdv": (16, 32, 1, 1), "dq": (32, 16, 1, 1)}
    elif dtype == torch.float32:
        tiles = {"fwd": (64, 32, 4, 2), "dkdv": (32, 32, 4, 1), "dq": (32, 32, 4, 1)}
    elif block_d <= 64:
        tiles = {"fwd": (128, 64, 4, 3), "dkdv": (32, 128, 4, 2), "dq": (128, 32, 4, 2)}
    else:
        tiles = {"fwd": (128, 64, 8, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
    return {name: dict(BLOCK_M=m, BLOCK_N=n, BLOCK_D=block_d, num_warps=w, num_stages=s)
            for name, (m, n, w, s) in tiles.items()}


def _flags(q: torch.Tensor, causal: bool, key_padding_mask, dropout) -> dict:
    return dict(
        CAUSAL=bool(causal),
        HAS_KPM=key_padding_mask is not None,
        HAS_DROPOUT=dropout is not None,
        UPCAST=q.device.type != "cuda",
        # fp32 inputs: exact fp32 products instead of the tf32 default
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _mask_arg(key_padding_mask, q):
    if key_padding_mask is None:
        return q, 0  # any pointer; never read when HAS_KPM is False
    kpm = key_padding_mask.to(torch.int8).contiguous()
    return kpm, kpm.stride(0)


def _dropout_args(dropout, q):
    """(row keys, col keys) as int32 pointers, threshold, scale; placeholders without dropout."""
    if dropout is None:
        return q, q, 0, 1.0  # pointers never read when HAS_DROPOUT is False
    return as_int32(dropout.row_keys), as_int32(dropout.col_keys), dropout.threshold, dropout.scale


def attention_forward_triton(q, k, v, causal, key_padding_mask, softmax_scale, dropout=None):
    """Triton forward. q [B, H, Sq, D], k/v [B, H, Sk, D] -> (out [B, H, Sq, D] q.dtype, lse [B, H, Sq] fp32)."""
    batch, heads, sq, dim = q.shape
    sk = k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    kpm, smb = _mask_arg(key_padding_mask, q)
    rk, ck, threshold, drop_scale = _dropout_args(dropout, q)
    cfg = _configs(dim, q.dtype, q.device)["fwd"]
    grid = (cdiv(sq, cfg["BLOCK_M"]), batch * heads)
    _attn_fwd_kernel[grid](
        q, k, v, kpm, rk, ck, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), smb,
        heads, sq, sk, dim, softmax_scale * _LOG2E, threshold, drop_scale,
        **_flags(q, causal, key_padding_mask, dropout), **cfg,
    )
    return out, lse


def attention_backward_triton(dout, q, k, v, out, lse, causal, key_padding_mask, softmax_scale, dropout=None,
                              lse_grad=None):
    """Triton backward (FA2): delta pass, dK/dV over key blocks, dQ over query blocks. Grads fp32.
    ``lse_grad`` [B, H, Sq] (optional) is subtracted from D."""
    batch, heads, sq, dim = q.shape
    sk = k.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty(batch, heads, sq, dtype=torch.float32, device=q.device)
    cfgs = _configs(dim, q.dtype, q.device)
    fwd = cfgs["fwd"]
    _attn_bwd_delta_kernel[(cdiv(sq, fwd["BLOCK_M"]), batch * heads)](
        out, dout, delta, *out.stride(), *dout.stride(), heads, sq, dim,
        BLOCK_M=fwd["BLOCK_M"], BLOCK_D=fwd["BLOCK_D"],
    )
    if lse_grad is not None:  # d lse / d s = P: the lse gradient enters as D - lse_grad
        delta -= lse_grad.to(torch.float32)
    kpm, smb = _mask_arg(key_padding_mask, q)
    rk, ck, threshold, drop_scale = _dropout_args(dropout, q)
    args = (q, k, v, kpm, rk, ck, dout, lse, delta)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), smb)
    scalars = (heads, sq, sk, dim, softmax_scale * _LOG2E, softmax_scale, threshold, drop_scale)
    flags = _flags(q, causal, key_padding_mask, dropout)
    cfg = cfgs["dkdv"]
    _attn_bwd_dkdv_kernel[(cdiv(sk, cfg["BLOCK_N"]), batch * heads)](
        *args, dk, dv, *strides, *scalars, **flags, **cfg)
    cfg = cfgs["dq"]
    _attn_bwd_dq_kernel[(cdiv(sq, cfg["BLOCK_M"]), batch * heads)](
        *args, dq, *strides, *scalars, **flags, **cfg)
    return dq, dk, dv
