"""Sequence sharding helpers: which chunks each rank holds, round trips and adjoint gradients."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardzoo.layers.sequence import (
    from_zigzag_order,
    gather_padding_mask,
    gather_sequence,
    shard_padding_mask,
    shard_sequence,
    to_zigzag_order,
    zigzag_chunk_order,
)
from shardzoo.testing import cached_mesh, error_messages, run_on_ranks


def test_zigzag_chunk_order_pairs_early_and_late_chunks():
    assert zigzag_chunk_order(1) == [0, 1]
    assert zigzag_chunk_order(2) == [0, 3, 1, 2]
    assert zigzag_chunk_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_order_round_trip(world):
    x = torch.arange(2 * world * 3).reshape(1, -1)
    assert torch.equal(from_zigzag_order(to_zigzag_order(x, world, 1), world, 1), x)


def check_shard_gather(seq, dim, zigzag, seed):
    """Shard and gather a tensor and a mask; check positions held and the adjoint gradients."""
    group = cached_mesh(sp=torch.distributed.get_world_size()).sp_group
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    positions = torch.arange(seq, dtype=torch.float64)
    shape = [2, 3, 2]
    shape.insert(dim, seq)
    x = positions.reshape([seq if d == dim else 1 for d in range(4)]).expand(shape).clone().requires_grad_(True)
    local = shard_sequence(x, group, dim, zigzag=zigzag)
    if zigzag:
        chunk = seq // (2 * world)
        held = list(range(rank * chunk, (rank + 1) * chunk))
        held += list(range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk))
    else:
        held = list(range(rank * seq // world, (rank + 1) * seq // world))
    assert local.movedim(dim, 0)[:, 0, 0, 0].tolist() == [float(p) for p in held]
    full = gather_sequence(local, group, dim, zigzag=zigzag)
    assert torch.equal(full.detach(), x.detach())
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (full * weights).sum().backward()  # the same loss on every rank: gradient = weights
    assert torch.equal(x.grad, weights)
    mask = torch.rand(2, seq, generator=torch.Generator().manual_seed(seed)) > 0.5
    local_mask = shard_padding_mask(mask, group, zigzag=zigzag)
    assert local_mask.dtype == torch.bool and local_mask[0].tolist() == mask[0, held].tolist()
    assert torch.equal(gather_padding_mask(local_mask, group, zigzag=zigzag), mask)


@pytest.mark.parametrize("world", [1, 2, 4])
@given(chunks=st.integers(1, 3), dim=st.integers(0, 3), zigzag=st.booleans(), seed=st.integers(0, 100))
def test_shard_and_gather_sequence(world, chunks, dim, zigzag, seed):
    run_on_ranks(check_shard_gather, world, 2 * world * chunks, dim, zigzag, seed)


def shard_uneven():
    group = cached_mesh(sp=2).sp_group
    return error_messages((
        lambda: shard_sequence(torch.zeros(1, 6), group, 1, zigzag=True),
        lambda: shard_padding_mask(torch.ones(1, 5, dtype=torch.bool), group),
        lambda: gather_sequence(torch.zeros(1, 3), group, 1, zigzag=True),
    ))


def test_uneven_sequence_raises_clear_error():
    zigzag_full, contiguous_mask, zigzag_local = run_on_ranks(shard_uneven, 2)[0]
    assert "length 6" in zigzag_full and "divisible by 4" in zigzag_full and "pad the sequence" in zigzag_full
    assert "length 5" in contiguous_mask and "divisible by 2" in contiguous_mask
    assert "local sequence length 3" in zigzag_local
