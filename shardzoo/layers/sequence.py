"""Sharding the sequence dimension over a sequence-parallel group, contiguous or zigzag.

Contiguous: rank r holds chunk r of P equal chunks. Zigzag (for causal attention): the
sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, concatenated, so every
rank owns as many early (cheap) as late (expensive) queries and ring attention is balanced::

    P = 2, chunks 0 1 2 3  ->  rank 0: [0, 3]   rank 1: [1, 2]

``shard_sequence`` / ``gather_sequence`` are differentiable and adjoint to each other under
replicated use (the full tensor is the same on every rank): sharding backward all-gathers the
gradient, gathering backward keeps this rank's slice. The padding-mask variants carry no
gradient.

Packed documents (``cu_seqlens``, int32 offsets): both use the balanced per-document split of
:mod:`shardzoo.layers.packing` instead (any lengths; local lengths differ by at most one
token), with the same adjoint gradients.
"""

from __future__ import annotations

import torch

from shardzoo.comm import gather_from, scatter_to
from shardzoo.comm import ops
from shardzoo.layers.packing import DocumentSplit, check_cu_seqlens, split_documents


def zigzag_chunk_order(world: int) -> list[int]:
    """Order of the 2P sequence chunks in zigzag layout: [0, 2P-1, 1, 2P-2, ...].

    Concatenating the chunks in this order and cutting the result into P contiguous pieces
    gives rank r the chunks r and 2P-1-r."""
    order: list[int] = []
    for r in range(world):
        order += [r, 2 * world - 1 - r]
    return order


def _check_length(x: torch.Tensor, dim: int, world: int, zigzag: bool, what: str, full: bool) -> None:
    parts = (2 * world if zigzag else world) if full else (2 if zigzag else 1)
    length = x.shape[dim]
    if length % parts != 0:
        layout = "zigzag" if zigzag else "contiguous"
        kind = "full" if full else "local"
        raise ValueError(
            f"{what}: the {kind} sequence length {length} (dim {dim} of shape {tuple(x.shape)}) is not "
            f"divisible by {parts}, which {layout} sharding over {world} ranks needs; pad the sequence "
            f"to a multiple of {parts * (1 if full else world)} tokens (padding mask False on the pad)"
        )


def to_zigzag_order(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """Permute the natural-order ``x`` along ``dim`` into zigzag chunk order (same shape)."""
    if world == 1:
        return x
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[i] for i in zigzag_chunk_order(world)], dim)


def from_zigzag_order(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`to_zigzag_order` (same shape)."""
    if world == 1:
        return x
    chunks = x.chunk(2 * world, dim)
    natural = [None] * (2 * world)
    for position, chunk_index in enumerate(zigzag_chunk_order(world)):
        natural[chunk_index] = chunks[position]
    return torch.cat(natural, dim)


def shard_positions(seq_local: int, rank: int, world: int, zigzag: bool, device=None) -> torch.Tensor:
    """Global positions, int64 [seq_local], of the tokens group rank ``rank`` of ``world`` holds:
    ``[rank*S/P, (rank+1)*S/P)`` contiguous, chunks ``rank`` and ``2P-1-rank`` (each
    seq_local/2 long) zigzag."""
    if not zigzag or world == 1:
        return torch.arange(rank * seq_local, (rank + 1) * seq_local, device=device)
    half = seq_local // 2
    first = torch.arange(rank * half, (rank + 1) * half, device=device)
    second = torch.arange((2 * world - 1 - rank) * half, (2 * world - rank) * half, device=device)
    return torch.cat([first, second])


def shard_sequence(x_full: torch.Tensor, group, dim: int, zigzag: bool = False, cu_seqlens=None) -> torch.Tensor:
    """This rank's sequence shard of the replicated ``x_full``.

    [.., S, ..] -> [.., S/P, ..] along ``dim``; zigzag puts chunks r and 2P-1-r (each S/2P)
    back to back. With ``cu_seqlens`` (int32 [docs + 1] offsets over S) the shard is this
    rank's part of the balanced per-document split (``zigzag`` is ignored; local lengths may
    differ by one token). Backward all-gathers the gradient (every rank gets the full gradient)."""
    world = ops.group_size(group)
    dim = dim % x_full.dim()
    if cu_seqlens is not None:
        split = packed_split(cu_seqlens, world, "shard_sequence", x_full.shape[dim])
        return _ShardPacked.apply(x_full, group, dim, split)
    _check_length(x_full, dim, world, zigzag, "shard_sequence", full=True)
    if zigzag:
        x_full = to_zigzag_order(x_full, world, dim)
    return scatter_to(x_full, group, dim)


def gather_sequence(x_local: torch.Tensor, group, dim: int, zigzag: bool = False, cu_seqlens=None) -> torch.Tensor:
    """The full sequence from every rank's shard, in natural order, on every rank.

    [.., S/P, ..] -> [.., S, ..] along ``dim`` (with ``cu_seqlens``: the shards of the
    per-document split, see :func:`shard_sequence`). The result is treated as replicated (every
    rank computes the same thing from it), so backward keeps this rank's slice of the gradient."""
    world = ops.group_size(group)
    dim = dim % x_local.dim()
    if cu_seqlens is not None:
        split = packed_split(cu_seqlens, world, "gather_sequence")
        _check_packed_local(x_local, dim, split, ops.group_rank(group), "gather_sequence")
        return _GatherPacked.apply(x_local, group, dim, split)
    if zigzag and world > 1:
        _check_length(x_local, dim, world, zigzag, "gather_sequence", full=False)
    x_full = gather_from(x_local, group, dim)
    return from_zigzag_order(x_full, world, dim) if zigzag else x_full


def packed_split(cu_seqlens, world: int, who: str, total: int | None = None) -> DocumentSplit:
    """The :class:`~shardzoo.layers.packing.DocumentSplit` of ``cu_seqlens`` over ``world``
    ranks, checking that the documents cover ``total`` tokens when given."""
    lengths = check_cu_seqlens(cu_seqlens, who)
    if total is not None and sum(lengths) != total:
        raise ValueError(f"{who}: cu_seqlens ends at {sum(lengths)} but the packed sequence has {total} tokens; "
                         "the last offset must be the full sequence length")
    return split_documents(lengths, world)


def _check_packed_local(x_local, dim, split: DocumentSplit, rank: int, who: str) -> None:
    if x_local.shape[dim] != split.local_len(rank):
        raise ValueError(f"{who}: rank {rank} holds {x_local.shape[dim]} tokens (dim {dim} of shape "
                         f"{tuple(x_local.shape)}) but the split of these cu_seqlens gives it {split.local_len(rank)}; "
                         "shard with shard_sequence(x, group, dim, cu_seqlens=cu_seqlens) using the same offsets")


def _all_gather_packed(x_local: torch.Tensor, group, dim: int, split: DocumentSplit) -> torch.Tensor:
    """Every rank's shard, padded to ``max_len``, all-gathered and put in natural order."""
    pad = split.max_len - x_local.shape[dim]
    if pad:
        shape = list(x_local.shape)
        shape[dim] = pad
        x_local = torch.cat([x_local, x_local.new_zeros(shape)], dim)
    stream = ops.all_gather(x_local, group, dim)
    return stream.index_select(dim, split.gather_index.to(stream.device))


class _ShardPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_full, group, dim, split):
        ctx.group, ctx.dim, ctx.split = group, dim, split
        rank = ops.group_rank(group)
        return x_full.index_select(dim, split.positions(rank, x_full.device))

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_packed(grad, ctx.group, ctx.dim, ctx.split), None, None, None


class _GatherPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, group, dim, split):
        ctx.group, ctx.dim, ctx.split = group, dim, split
        return _all_gather_packed(x_local, group, dim, split)

    @staticmethod
    def backward(ctx, grad):
        rank = ops.group_rank(ctx.group)
        return grad.index_select(ctx.dim, ctx.split.positions(rank, grad.device)), None, None, None


def shard_padding_mask(mask_full: torch.Tensor, group, zigzag: bool = False) -> torch.Tensor:
    """This rank's [B, S/P] slice of a bool key padding mask [B, S] (True = attend)."""
    world = ops.group_size(group)
    _check_length(mask_full, 1, world, zigzag, "shard_padding_mask", full=True)
    if zigzag:
        mask_full = to_zigzag_order(mask_full, world, 1)
    return ops.split_local(mask_full, group, 1)


def gather_padding_mask(mask_local: torch.Tensor, group, zigzag: bool = False) -> torch.Tensor:
    """The full [B, S] bool mask from every rank's [B, S/P] slice, in natural order."""
    world = ops.group_size(group)
    if world == 1:
        return mask_local
    if zigzag:
        _check_length(mask_local, 1, world, zigzag, "gather_padding_mask", full=False)
    # bytes on the wire: gloo / NCCL all-gather uint8 everywhere, bool not on every backend
    full = ops.all_gather(mask_local.to(torch.uint8), group, 1).to(torch.bool)
    return from_zigzag_order(full, world, 1) if zigzag else full
