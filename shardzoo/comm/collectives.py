"""Autograd-aware collectives, each written once and parameterised by ``(group, dim)``.

Forward / backward pairs (each backward is the exact adjoint of its forward under the stated
use):

============== ============================== ==========================================
op             forward                         backward
============== ============================== ==========================================
copy_to        identity                        all_reduce (sum) of the gradient
reduce_from    all_reduce (sum)                identity (output consumed replicated)
all_reduce     all_reduce (sum)                all_reduce (output consumed per rank)
scatter_to     keep this rank's chunk of dim   all_gather along dim
gather_from    all_gather along dim            keep this rank's chunk (output replicated)
all_gather     all_gather along dim            reduce_scatter along dim (output per rank)
reduce_scatter reduce_scatter along dim        all_gather along dim
all_to_all     split scatter_dim, cat gather   all_to_all with the dims swapped
all_to_all_v   rows to members, uneven counts  all_to_all_v with the counts swapped
broadcast      member src's tensor everywhere  reduce (sum) to src, zero elsewhere
============== ============================== ==========================================

"Replicated" means every rank goes on to compute the same thing from the output (Megatron's
f / g pairs); "per rank" means ranks use the output differently (sequence parallelism, split
statistics), so gradients from all ranks must be summed. Every op is the identity on a group of
size 1.
"""

from __future__ import annotations

import torch

from shardzoo.comm import ops


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ops.all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace=False):
        if inplace:
            ctx.mark_dirty(x)
        return ops.all_reduce(x, group, inplace=inplace)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return ops.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ops.all_reduce(grad, ctx.group), None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.split_local(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ops.all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ops.split_local(grad, ctx.group, ctx.dim), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ops.reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ops.all_gather(grad, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return ops.all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return ops.all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send_splits, recv_splits):
        ctx.group, ctx.splits = group, (send_splits, recv_splits)
        return ops.all_to_all_uneven(x, group, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return ops.all_to_all_uneven(grad, ctx.group, recv_splits, send_splits), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, src):
        ctx.group, ctx.src = group, src
        return ops.broadcast(x, group, src)

    @staticmethod
    def backward(ctx, grad):
        return ops.reduce(grad, ctx.group, ctx.src), None, None


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % max(x.dim(), 1)


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a parallel region: identity forward, gradient summed over ``group`` backward.
    Shape unchanged."""
    if ops.group_size(group) == 1:
        return x
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group, inplace: bool = False) -> torch.Tensor:
    """Leave a parallel region: sum over ``group`` forward, identity backward. Shape unchanged.

    ``inplace=True`` sums into ``x`` itself and returns it, saving a copy; only for a tensor
    nothing else reads (e.g. a matmul output the caller has just made)."""
    if ops.group_size(group) == 1:
        return x
    return _ReduceFrom.apply(x, group, inplace)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` whose output each rank uses differently: backward sums gradients too.
    Shape unchanged."""
    if ops.group_size(group) == 1:
        return x
    return _AllReduce.apply(x, group)


def scatter_to(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of the replicated ``x`` along ``dim``: [.., n, ..] -> [.., n/p, ..]."""
    if ops.group_size(group) == 1:
        return x
    dim = _norm_dim(x, dim)
    ops.check_divisible(x, dim, ops.group_size(group), "scatter_to")
    return _ScatterTo.apply(x, group, dim)


def gather_from(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` into a replicated tensor:
    [.., n/p, ..] -> [.., n, ..]; backward keeps this rank's slice of the gradient."""
    if ops.group_size(group) == 1:
        return x
    return _GatherFrom.apply(x, group, _norm_dim(x, dim))


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` when ranks use the result differently:
    [.., n/p, ..] -> [.., n, ..]; backward reduce-scatters the gradient."""
    if ops.group_size(group) == 1:
        return x
    return _AllGather.apply(x, group, _norm_dim(x, dim))


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's chunk along ``dim``: [.., n, ..] -> [.., n/p, ..];
    backward all-gathers."""
    if ops.group_size(group) == 1:
        return x
    dim = _norm_dim(x, dim)
    ops.check_divisible(x, dim, ops.group_size(group), "reduce_scatter")
    return _ReduceScatter.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split along ``scatter_dim`` and concatenate along ``gather_dim`` across ``group``:
    shape[scatter_dim] / p and shape[gather_dim] * p (Ulysses sequence <-> heads swap)."""
    if ops.group_size(group) == 1:
        return x
    scatter_dim, gather_dim = _norm_dim(x, scatter_dim), _norm_dim(x, gather_dim)
    ops.check_divisible(x, scatter_dim, ops.group_size(group), "all_to_all")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def all_to_all_v(x: torch.Tensor, group, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Uneven all-to-all of the rows of ``x`` (ops.all_to_all_uneven): ``send_splits[i]`` rows to
    member i, ``recv_splits[i]`` received from it, in member order: [sum(send), ...] ->
    [sum(recv), ...]. Backward sends the gradient rows back the same way (counts swapped)."""
    if ops.group_size(group) == 1:
        return x
    return _AllToAllUneven.apply(x, group, list(send_splits), list(recv_splits))


def broadcast(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """Member ``src``'s ``x`` (group-local rank) on every rank; every rank passes a tensor of
    the same shape and dtype. Backward sums the gradients onto ``src``."""
    p = ops.group_size(group)
    if not 0 <= src < p:
        raise ValueError(f"broadcast src={src} is not a rank of a group of size {p}; use 0..{p - 1}")
    if p == 1:
        return x
    return _Broadcast.apply(x, group, src)
