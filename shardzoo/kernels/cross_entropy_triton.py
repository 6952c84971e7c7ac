"""Triton kernels for vocab-parallel cross-entropy partials and gradient, one row per program
looping over the local vocabulary in chunks (fp32 math)."""
from __future__ import annotations

import torch

from ._triton import jit, tl


@jit
def _ce_partials_kernel(
    Logits, Target, RowMax, SumExp, TargetLogit, SumLogits, stride_row, V, vocab_start,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = Logits + row * stride_row
    m = float("-inf")
    s = 0.0
    total = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: avoid inf - inf
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
        total += tl.sum(tl.where(mask, x, 0.0), 0)
    target = tl.load(Target + row)
    local = target - vocab_start
    in_range = (target >= 0) & (local >= 0) & (local < V)
    t_logit = tl.load(base + tl.where(in_range, local, 0)).to(tl.float32)
    tl.store(RowMax + row, m)
    tl.store(SumExp + row, s)
    tl.store(TargetLogit + row, tl.where(in_range, t_logit, 0.0))
    tl.store(SumLogits + row, total)


@jit
def _ce_grad_kernel(
    Logits, Target, Lse, GradRow, DLogits, stride_row, stride_drow, V, vocab_start, onehot_coef, smooth_coef,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Target + row)
    valid = target >= 0
    local = target - vocab_start
    lse = tl.load(Lse + row)
    g = tl.load(GradRow + row).to(tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(Logits + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.exp(x - lse) - smooth_coef - tl.where(cols == local, onehot_coef, 0.0)
        d = tl.where(valid, d * g, 0.0)  # ignored rows: exactly 0 even if their lse is not finite
        tl.store(DLogits + row * stride_drow + cols, d.to(DLogits.dtype.element_ty), mask=mask)


def _block_v(logits: torch.Tensor) -> int:
    return 4096 if logits.device.type == "cuda" else 256


def _rows(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def cross_entropy_partials_triton(logits, target, vocab_start):
    """logits [N, V_local], target [N] -> (row_max, sum_exp, target_logit, sum_logits), fp32 [N] each."""
    logits = _rows(logits)
    n, v = logits.shape
    outs = [torch.zeros(n, dtype=torch.float32, device=logits.device) for _ in range(4)]
    if v == 0:  # a rank holding no vocab columns
        outs[0].fill_(float("-inf"))
    elif n:
        block = _block_v(logits)
        _ce_partials_kernel[(n,)](logits, target.contiguous(), *outs, logits.stride(0), v, int(vocab_start),
                                  BLOCK_V=block, num_warps=8 if block >= 4096 else 4)
    return tuple(outs)


def cross_entropy_grad_triton(logits, target, vocab_start, lse, grad_row, label_smoothing, vocab_size):
    """-> dlogits [N, V_local] in logits' dtype."""
    logits = _rows(logits)
    n, v = logits.shape
    dlogits = torch.empty_like(logits)
    if n and v:
        block = _block_v(logits)
        _ce_grad_kernel[(n,)](
            logits, target.contiguous(), lse.to(torch.float32).contiguous(), grad_row.to(torch.float32).contiguous(),
            dlogits, logits.stride(0), dlogits.stride(0), v, int(vocab_start),
            1.0 - float(label_smoothing), float(label_smoothing) / float(vocab_size),
            BLOCK_V=block, num_warps=8 if block >= 4096 else 4)
    return dlogits
