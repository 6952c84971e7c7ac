"""Vocab-parallel cross entropy over any process group (1D, 2D, 2.5D, 3D layouts alike).

Each rank of ``group`` holds the logits of one contiguous vocabulary slice
``[vocab_start, vocab_start + V_local)``; columns at global ids ``>= vocab_size`` are padding and
are left out. Per row, with x the logits and t the target:

    lse  = log sum_v exp(x_v)                       (max all-reduce, then one sum all-reduce
    loss = lse - (1 - ls) * x_t - ls * mean_v x_v    of [sum_exp, x_t, sum_v x_v] together)

which is ``F.cross_entropy(..., label_smoothing=ls)``. Full logits are never formed; the
backward needs no communication (each rank owns its slice of d loss / d logits).
The per-rank statistics and the gradient come from ``shardzoo.kernels`` (Triton on CUDA,
the torch reference on CPU), in fp32 for fp16 / bf16 / fp32 logits; fp64 logits are handled
here in fp64 so fp64 runs stay exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from shardzoo.comm import ops
from shardzoo.comm.accounting import record

try:
    from shardzoo.kernels.cross_entropy import cross_entropy_grad, cross_entropy_partials
except ImportError:  # kernels are optional; the fp64 path below serves every dtype
    cross_entropy_grad = cross_entropy_partials = None

REDUCTIONS = ("mean", "sum", "none")


class _Settings(NamedTuple):
    group: object
    vocab_start: int
    vocab_size: int
    label_smoothing: float
    reduction: str


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    p = ops.group_size(group)
    if p == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    record("all_reduce", out.numel() * out.element_size(), p)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def _use_kernels(x: torch.Tensor) -> bool:
    return cross_entropy_partials is not None and x.dtype != torch.float64 and x.shape[1] > 0


def _partials(x: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """(row_max, sum_exp, target_logit, sum_logits), each [N], for local logits x [N, V_valid]."""
    if _use_kernels(x):
        return cross_entropy_partials(x.contiguous(), target, vocab_start)  # a copy only on padded ranks
    stat = torch.promote_types(x.dtype, torch.float32)
    n = x.shape[0]
    if x.shape[1] == 0:  # a rank holding only padding columns
        zeros = x.new_zeros(n, dtype=stat)
        return torch.full_like(zeros, -float("inf")), zeros, zeros, zeros
    x = x.to(stat)
    row_max = x.amax(-1)
    sum_exp = (x - row_max[:, None]).exp_().sum(-1)  # in place: one [N, V] temporary, not two
    local = target - vocab_start
    here = (target >= 0) & (local >= 0) & (local < x.shape[1])
    picked = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
    return row_max, sum_exp, torch.where(here, picked, torch.zeros_like(picked)), x.sum(-1)


def _grad(x, target, vocab_start, lse, grad_row, label_smoothing, vocab_size):
    """d loss / d x for local logits x [N, V_valid]; rows with target < 0 are zero."""
    if _use_kernels(x):
        return cross_entropy_grad(x.contiguous(), target, vocab_start, lse, grad_row.contiguous(), label_smoothing,
                                  vocab_size)
    if x.shape[1] == 0:
        return torch.zeros_like(x)
    # every step in place on the one new [N, V] tensor: the logits' size once, as log_softmax's backward
    grad = (x.to(lse.dtype) - lse[:, None]).exp_()
    if label_smoothing:
        grad.sub_(label_smoothing / vocab_size)
    local = target - vocab_start
    here = (target >= 0) & (local >= 0) & (local < x.shape[1])
    rows = torch.nonzero(here).squeeze(1)
    grad[rows, local[rows]] -= 1.0 - label_smoothing
    grad.mul_(grad_row[:, None]).masked_fill_((target < 0)[:, None], 0.0)
    return grad.to(x.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits [N, V_local] (this rank's slice), target [N] (global ids, -1 = ignored) -> loss."""

    @staticmethod
    def forward(ctx, logits, target, s: _Settings):
        valid_cols = max(0, min(logits.shape[1], s.vocab_size - s.vocab_start))
        x = logits[:, :valid_cols]
        row_max, sum_exp, target_logit, sum_logits = _partials(x, target, s.vocab_start)
        global_max = _all_reduce_max(row_max, s.group)
        # rescale each rank's sum_exp to the global max; -inf local max (no columns) gives 0
        scaled = torch.where(sum_exp > 0, sum_exp * torch.exp(row_max - global_max), torch.zeros_like(sum_exp))
        sums = ops.all_reduce(torch.stack([scaled, target_logit, sum_logits]), s.group)
        lse = global_max + torch.log(sums[0])
        ls = s.label_smoothing
        loss = lse - (1.0 - ls) * sums[1] - ls * sums[2] / s.vocab_size
        counted = target >= 0
        loss = torch.where(counted, loss, torch.zeros_like(loss))
        n_counted = counted.sum()
        ctx.save_for_backward(logits, target, lse, n_counted)
        ctx.settings = s
        if s.reduction == "none":
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / n_counted if s.reduction == "mean" else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse, n_counted = ctx.saved_tensors
        s: _Settings = ctx.settings
        grad = grad.to(lse.dtype)
        if s.reduction == "none":
            grad_row = grad
        else:
            grad_row = (grad / n_counted if s.reduction == "mean" else grad).expand(logits.shape[0])
        valid_cols = max(0, min(logits.shape[1], s.vocab_size - s.vocab_start))
        dx = _grad(logits[:, :valid_cols], target, s.vocab_start, lse, grad_row, s.label_smoothing, s.vocab_size)
        if valid_cols == logits.shape[1]:
            return dx, None, None
        dlogits = logits.new_zeros(logits.shape)  # padding columns get no gradient
        dlogits[:, :valid_cols] = dx
        return dlogits, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of vocab-split logits, equal to ``F.cross_entropy`` on the gathered logits.

    Args:
        logits: [..., V_local], this rank's vocabulary slice starting at global id
            ``vocab_start``; columns whose global id is ``>= vocab_size`` are padding (ignored).
        target: [...] global class ids in ``[0, vocab_size)`` or ``ignore_index``; the same on
            every rank of ``group``.
        group: the process group the vocabulary is split over (any size; 1 is serial).
        vocab_start: global id of local column 0.
        vocab_size: the real (unpadded) vocabulary size.
        ignore_index, label_smoothing, reduction: as in ``F.cross_entropy``; "mean" divides by
            the number of targets that are not ``ignore_index``.

    Returns:
        a scalar ("mean", "sum") or per-position losses shaped like ``target`` ("none"), in
        ``logits.dtype``, identical on every rank of ``group``.
    """
    op = "vocab_parallel_cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r} is not one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: target shape {tuple(target.shape)} must equal logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])} (class ids, one per logits row)")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target.dtype={target.dtype} must be int64 or int32 class ids")
    if not 0 <= vocab_start or vocab_size < 1:
        raise ValueError(f"{op}: need vocab_start >= 0 and vocab_size >= 1; got {vocab_start}, {vocab_size}")
    v_local = logits.shape[-1]
    flat_target = target.reshape(-1).long()
    ignored = flat_target == ignore_index
    bad = ~ignored & ((flat_target < 0) | (flat_target >= vocab_size))
    if bool(bad.any()):
        value = int(flat_target[bad][0])
        raise ValueError(f"{op}: target id {value} is outside [0, {vocab_size}) and is not "
                         f"ignore_index={ignore_index}; fix the labels or pass the right ignore_index / vocab_size")
    flat_target = torch.where(ignored, torch.full_like(flat_target, -1), flat_target)
    settings = _Settings(group, int(vocab_start), int(vocab_size), float(label_smoothing), reduction)
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, v_local), flat_target, settings)
    return loss.reshape(target.shape) if reduction == "none" else loss
