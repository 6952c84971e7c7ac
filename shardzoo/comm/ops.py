"""Plain (non-autograd) collectives along any tensor dimension, with accounting.

Every function takes a process group and, where it applies, the tensor dimension it works on.
A group of size 1 (or ``None`` while torch.distributed is not initialised) is a no-op, so the
serial model runs the same code. The autograd wrappers in ``collectives.py`` call these.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardzoo.comm.accounting import record

# torch 2.13 names first; older releases only have the later entries.
_ALL_GATHER = next(
    getattr(dist, n) for n in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base") if hasattr(dist, n)
)
_REDUCE_SCATTER = next(
    getattr(dist, n)
    for n in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
    if hasattr(dist, n)
)


def group_size(group) -> int:
    """Number of ranks in ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside ``group``; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def global_rank(group, rank_in_group: int) -> int:
    """Global rank of the member ``rank_in_group`` of ``group``."""
    if group is None or group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def check_divisible(x: torch.Tensor, dim: int, parts: int, op: str) -> None:
    """Raise a clear error unless ``x.shape[dim]`` splits evenly into ``parts``."""
    if x.dim() == 0:
        raise ValueError(f"{op} needs a tensor with at least one dimension; got a scalar")
    size = x.shape[dim]
    if size % parts != 0:
        raise ValueError(
            f"{op} splits dim {dim} of a tensor of shape {tuple(x.shape)} over {parts} ranks, "
            f"but {size} is not divisible by {parts}; pad that dimension to a multiple of {parts} "
            f"or choose a group size that divides it"
        )


def split_local(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    p = group_size(group)
    if p == 1:
        return x
    check_divisible(x, dim, p, "split")
    return x.chunk(p, dim)[group_rank(group)].contiguous()


def all_reduce(x: torch.Tensor, group, inplace: bool = False) -> torch.Tensor:
    """Sum of ``x`` over the group, same shape on every rank."""
    p = group_size(group)
    if p == 1:
        return x
    out = x if inplace else x.clone(memory_format=torch.contiguous_format)
    all_reduce_start(out, group).wait()
    return out


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``x``: shape[dim] grows p times."""
    p = group_size(group)
    if p == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((p * moved.shape[0],) + tuple(moved.shape[1:]))
    record("all_gather", _nbytes(out), p)
    _ALL_GATHER(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over the group, then keep this rank's chunk along ``dim`` (shape[dim] / p)."""
    finish, _ = reduce_scatter_start(x, group, dim)
    return finish()


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim``, send chunk i to rank i, concatenate what arrives
    along ``gather_dim``: shape[scatter_dim] / p, shape[gather_dim] * p."""
    p = group_size(group)
    if p == 1:
        return x
    check_divisible(x, scatter_dim, p, "all_to_all")
    # Chunk i must be the i-th block of memory; along dim 0 it already is (no copy).
    if scatter_dim == 0:
        send = x.contiguous().view((p, x.shape[0] // p) + tuple(x.shape[1:]))
    else:
        send = torch.stack(x.chunk(p, scatter_dim), 0).contiguous()
    recv = torch.empty_like(send)
    record("all_to_all", _nbytes(send), p)
    dist.all_to_all_single(recv, send, group=group)
    if gather_dim == 0:
        return recv.view((p * recv.shape[1],) + tuple(recv.shape[2:]))
    return torch.cat(recv.unbind(0), gather_dim)


def all_to_all_uneven(x: torch.Tensor, group, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Rows of ``x`` to the members of ``group``: the first ``send_splits[0]`` rows to member 0,
    the next ``send_splits[1]`` to member 1, ...; returns the rows received, ``recv_splits[i]``
    from member i, in member order: [sum(send_splits), ...] -> [sum(recv_splits), ...]. Every
    member's ``recv_splits[j]`` is member j's ``send_splits`` entry for it. Counted as the bytes
    of the rows this rank sends to the other members (its own stay)."""
    p = group_size(group)
    if p == 1:
        return x
    if len(send_splits) != p or len(recv_splits) != p or sum(send_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_uneven over {p} ranks needs {p} send and receive counts with the send counts "
                         f"summing to the {x.shape[0]} rows of x; got send {send_splits}, receive {recv_splits}")
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    row_bytes = math.prod(x.shape[1:]) * x.element_size()  # x may hold no rows (no token for this rank)
    record("all_to_all_v", row_bytes * (sum(send_splits) - send_splits[group_rank(group)]), p)
    dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                           group=group)
    return out


def broadcast(x: torch.Tensor, group, src: int) -> torch.Tensor:
    """``x`` of group member ``src`` on every rank (every rank passes a tensor of that shape)."""
    p = group_size(group)
    if p == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format) if group_rank(group) == src else torch.empty_like(
        x, memory_format=torch.contiguous_format
    )
    record("broadcast", _nbytes(out), p)
    dist.broadcast(out, src=global_rank(group, src), group=group)
    return out


def reduce(x: torch.Tensor, group, dst: int) -> torch.Tensor:
    """Sum over the group on member ``dst``; zeros elsewhere (the adjoint of broadcast)."""
    p = group_size(group)
    if p == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    record("reduce", _nbytes(out), p)
    dist.reduce(out, dst=global_rank(group, dst), group=group)
    if group_rank(group) != dst:
        out.zero_()
    return out


def all_reduce_start(x: torch.Tensor, group):
    """Start summing ``x`` (contiguous) over the group in place; returns the work handle
    (``.wait()`` it before reading ``x``), or None on a group of size 1."""
    p = group_size(group)
    if p == 1:
        return None
    record("all_reduce", _nbytes(x), p)
    return dist.all_reduce(x, group=group, async_op=True)


def reduce_scatter_start(x: torch.Tensor, group, dim: int):
    """Start :func:`reduce_scatter`; returns ``(finish, work)`` where ``finish()`` waits and
    returns this rank's chunk (shape[dim] / p). On a group of size 1: ``(lambda: x, None)``."""
    p = group_size(group)
    if p == 1:
        return (lambda: x), None
    check_divisible(x, dim, p, "reduce_scatter")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // p,) + tuple(moved.shape[1:]))
    record("reduce_scatter", _nbytes(moved), p)
    work = _REDUCE_SCATTER(out, moved, group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out.movedim(0, dim)

    return finish, work
