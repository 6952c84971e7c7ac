"""Sharding the sequence dimension over a sequence-parallel group, contiguous or zigzag.

Contiguous: rank r holds chunk r of P equal chunks. Zigzag (for causal attention): the
sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, concatenated, so every
rank owns as many early (cheap) as late (expensive) queries and ring attention is balanced::

    P = 2, chunks 0 1 2 3  ->  rank 0: [0, 3]   rank 1: [1, 2]

``shard_sequence`` / ``gather_sequence`` are differentiable and adjoint to each other under
replicated use (the full tensor is the same on every rank): sharding backward all-gathers the
gradient, gathering backward keeps this rank's slice. The padding-mask variants carry no
gradient.
"""

from __future__ import annotations

import torch

from shardzoo.comm import gather_from, scatter_to
from shardzoo.comm import ops


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


def shard_sequence(x_full: torch.Tensor, group, dim: int, zigzag: bool = False) -> torch.Tensor:
    """This rank's sequence shard of the replicated ``x_full``.

    [.., S, ..] -> [.., S/P, ..] along ``dim``; zigzag puts chunks r and 2P-1-r (each S/2P)
    back to back. Backward all-gathers the gradient (every rank gets the full gradient)."""
    world = ops.group_size(group)
    dim = dim % x_full.dim()
    _check_length(x_full, dim, world, zigzag, "shard_sequence", full=True)
    if zigzag:
        x_full = to_zigzag_order(x_full, world, dim)
    return scatter_to(x_full, group, dim)


def gather_sequence(x_local: torch.Tensor, group, dim: int, zigzag: bool = False) -> torch.Tensor:
    """The full sequence from every rank's shard, in natural order, on every rank.

    [.., S/P, ..] -> [.., S, ..] along ``dim``. The result is treated as replicated (every rank
    computes the same thing from it), so backward keeps this rank's slice of the gradient."""
    world = ops.group_size(group)
    dim = dim % x_local.dim()
    if zigzag and world > 1:
        _check_length(x_local, dim, world, zigzag, "gather_sequence", full=False)
    x_full = gather_from(x_local, group, dim)
    return from_zigzag_order(x_full, world, dim) if zigzag else x_full


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
