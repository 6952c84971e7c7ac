"""The column layer's matmul with its backward communication overlapped (Megatron style).

Backward of ``y = x W^T + b`` for a column-parallel layer: this rank's ``dX = dY W`` is only a
partial sum over the tp group, so it must be all-reduced (reduce-scattered along the sequence
under sequence parallelism). The weight gradient ``dW = dY^T X`` does not need it, so the
collective is started first and runs while dW is computed. Built as one autograd Function so
the order is fixed (autograd would compute dW before handing dX to a separate collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardzoo.comm import ops
from shardzoo.layers.common_1d import SEQ_DIM
from shardzoo.layers.needed_grads import grads_needed, mark_tensors


def _autocast_dtype(x: torch.Tensor):
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class ColumnLinearFunction(torch.autograd.Function):
    """x [b, s_in, in] -> x W^T + b [b, s, out/p]; s_in = s/p with sequence parallelism."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        # autocast does not reach inside a Function's backward: cast here, once, as autocast would
        compute = _autocast_dtype(x) or x.dtype
        mark_tensors(ctx, x, weight, bias, group, sequence_parallel)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        x_c, w_c = x.to(compute), weight.to(compute)
        b_c = bias.to(compute) if bias is not None else None
        total = ops.all_gather(x_c, group, SEQ_DIM) if sequence_parallel else x_c
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(total, w_c, b_c)
        ctx.save_for_backward(total, w_c)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        total, w_c = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = grads_needed(ctx)[:3]  # a split backward asks for dx or dW alone
        dy = dy.to(w_c.dtype)
        dx = finish = work = None
        if need_x:
            dx = dy.matmul(w_c)  # fresh: reduced in place
            if ctx.sequence_parallel:
                finish, _ = ops.reduce_scatter_start(dx, ctx.group, SEQ_DIM)
            else:
                work = ops.all_reduce_start(dx, ctx.group)
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), total.reshape(-1, total.shape[-1])
        dw = dy2.t().matmul(x2).to(w_dtype) if need_w else None
        db = dy2.sum(0).to(b_dtype) if ctx.has_bias and need_b else None
        if finish is not None:
            dx = finish()
        elif work is not None:
            work.wait()
        return (dx.to(x_dtype) if dx is not None else None), dw, db, None, None


def column_linear(x, weight, bias, group, sequence_parallel: bool) -> torch.Tensor:
    """Column-parallel ``F.linear`` with the tp communication of its input built in:
    x [b, s_in, in] (s_in = s/p under sequence parallelism) -> [b, s, out/p]."""
    return ColumnLinearFunction.apply(x, weight, bias, group, sequence_parallel)
