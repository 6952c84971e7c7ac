"""Triton LayerNorm kernels: forward one row per program; backward computes dx per row and
per-program partial sums of dweight / dbias that are reduced afterwards."""
from __future__ import annotations

import torch

from ._triton import cdiv, jit, next_power_of_2, tl

MAX_COLS = 65536  # a whole row lives in registers


@jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, Mean, Rstd, stride_x, stride_y, N, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / N
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, 0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@jit
def _layer_norm_bwd_kernel(
    DY, X, W, Mean, Rstd, DX, DW_part, DB_part, stride_dy, stride_x, stride_dx, n_rows, N, rows_per_program,
    HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.full([BLOCK_N], 1.0, tl.float32)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_N], tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 row index: row * stride may pass 2**31
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for r in range(row_start, row_end):
        x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + r)
        rstd = tl.load(Rstd + r)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, 0) / N
        c2 = tl.sum(wdy, 0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + r * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(DW_part + pid * N + cols, dw_acc, mask=mask)
    tl.store(DB_part + pid * N + cols, db_acc, mask=mask)


def _num_warps(block: int) -> int:
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def layer_norm_forward_triton(x, weight, bias, eps):
    """x [..., N] -> (y [..., N] x.dtype, mean [...] fp32, rstd [...] fp32)."""
    n = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows > 0:
        block = next_power_of_2(n)
        _layer_norm_fwd_kernel[(rows,)](
            x2, weight if weight is not None else x2, bias if bias is not None else x2, y, mean, rstd,
            x2.stride(0), y.stride(0), n, float(eps),
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_N=block, num_warps=_num_warps(block),
        )
    lead = x.shape[:-1]
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def layer_norm_backward_triton(dy, x, weight, mean, rstd):
    """-> (dx [..., N] x.dtype, dweight [N] fp32 or None, dbias [N] fp32)."""
    n = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    rows = x2.shape[0]
    dx = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if x.device.type == "cuda":
        programs = min(rows, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:
        programs = min(rows, 4)  # interpreter: programs run one after another anyway
    programs = max(programs, 1)
    per_program = cdiv(max(rows, 1), programs)
    dw_part = torch.zeros((programs, n), dtype=torch.float32, device=x.device)
    db_part = torch.zeros((programs, n), dtype=torch.float32, device=x.device)
    if rows > 0:
        block = next_power_of_2(n)
        _layer_norm_bwd_kernel[(programs,)](
            dy2, x2, weight if weight is not None else x2, mean.reshape(-1).contiguous(),
            rstd.reshape(-1).contiguous(), dx, dw_part, db_part,
            dy2.stride(0), x2.stride(0), dx.stride(0), rows, n, per_program,
            HAS_W=weight is not None, BLOCK_N=block, num_warps=_num_warps(block),
        )
    dweight = dw_part.sum(0) if weight is not None else None
    return dx.reshape(x.shape), dweight, db_part.sum(0)
