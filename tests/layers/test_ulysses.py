"""Ulysses attention against serial SDPA on the full sequence: outputs and dq / dk / dv.

Same pattern as test_ring_attention.py (shared parts in support.sequence_attention):
full inputs from the seed on every rank, fp64 SDPA reference, shard (zigzag when causal),
attend over the sp group, gather."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardzoo import comm
from shardzoo.layers.ulysses import ulysses_attention
from shardzoo.testing import cached_mesh, run_on_ranks
from support.sequence_attention import (DROP_P, DROP_SEED, DTYPES, MASK_KINDS, compare, full_inputs, make_mask,
                                                 parallel_attention, reference_grads, single_rank_dropout)


def check_ulysses(case, zigzag=None):
    world = torch.distributed.get_world_size()
    batch, heads, seq, head_dim, causal, mask_kind, dtype_name, seed = case
    dtype = DTYPES[dtype_name]
    group = cached_mesh(sp=world).sp_group
    q, k, v, dout = full_inputs(batch, heads, seq, head_dim, dtype, seed)
    sharded_zigzag = causal if zigzag is None else zigzag
    mask = make_mask(mask_kind, batch, seq, world, sharded_zigzag, seed)
    expected = reference_grads(q, k, v, dout, mask, causal)
    actual = parallel_attention(ulysses_attention, q, k, v, dout, mask, causal, group, sharded_zigzag, zigzag=zigzag)
    compare(actual, expected, dtype, f"ulysses sp={world} zigzag={zigzag} case={case}")


@st.composite
def ulysses_case(draw, world):
    causal = draw(st.booleans())
    seq = 2 * world * draw(st.integers(1, 4)) if causal else world * draw(st.integers(1, 8))
    return (
        draw(st.integers(1, 2)),  # batch
        world * draw(st.integers(1, 2)),  # heads, divisible by sp
        seq,
        draw(st.sampled_from([16, 24, 32, 64])),  # head_dim
        causal,
        draw(st.sampled_from(MASK_KINDS)),
        draw(st.sampled_from(["fp32", "fp64"])),
        draw(st.integers(0, 10**6)),
    )


@pytest.mark.parametrize("world", [1, 2, 4])
@given(data=st.data())
def test_ulysses_attention_matches_sdpa(world, data):
    run_on_ranks(check_ulysses, world, data.draw(ulysses_case(world)))


@pytest.mark.parametrize("causal,zigzag", [(True, False), (False, True)])
def test_ulysses_attention_other_layouts(causal, zigzag):
    """Contiguous causal shards (zigzag=False) and zigzag shards without causality."""
    run_on_ranks(check_ulysses, 4, (2, 4, 32, 16, causal, "rank_padded", "fp32", 5), zigzag)


def test_ulysses_attention_bf16():
    run_on_ranks(check_ulysses, 2, (2, 4, 64, 32, True, "random", "bf16", 11))


def check_ulysses_with_tp(causal, seed):
    """tp=2 x sp=2: each tp rank takes half the heads, Ulysses splits them again over sp."""
    mesh = cached_mesh(sp=2, tp=2)
    heads, seq = 8, 16
    q, k, v, dout = full_inputs(2, heads, seq, 16, torch.float32, seed)
    mask = make_mask("random", 2, seq, 2, causal, seed)
    per_tp = heads // mesh.tp_size
    mine = slice(mesh.tp_rank * per_tp, (mesh.tp_rank + 1) * per_tp)
    q, k, v, dout = (t[:, mine].contiguous() for t in (q, k, v, dout))
    expected = reference_grads(q, k, v, dout, mask, causal)
    actual = parallel_attention(ulysses_attention, q, k, v, dout, mask, causal, mesh.sp_group)
    compare(actual, expected, torch.float32, f"ulysses tp=2 sp=2 rank {mesh.rank()}")


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_attention_with_tensor_parallel_heads(causal):
    run_on_ranks(check_ulysses_with_tp, 4, causal, 3)


def count_ulysses_bytes():
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    mask = torch.rand(2, 8) > 0.2
    with comm.count() as forward:
        ulysses_attention(q, k, v, group=group, key_padding_mask=mask)
    return forward.bytes, q.numel() * 4, mask.numel() * world, world


def test_ulysses_attention_communication_volume():
    """Forward: all-to-alls of q, k, v and out, (P-1)/P of a q-sized tensor each, plus the mask."""
    for sent, q_bytes, mask_bytes, p in run_on_ranks(count_ulysses_bytes, 4):
        assert sent["all_to_all"] == 4 * q_bytes * (p - 1) / p
        assert sent["all_gather"] == mask_bytes * (p - 1) / p


def indivisible_heads():
    q = torch.randn(1, 3, 4, 8)
    try:
        ulysses_attention(q, q, q, group=cached_mesh(sp=2).sp_group)
    except ValueError as e:
        return str(e)
    return None


def test_ulysses_attention_indivisible_heads_raises_clear_error():
    for message in run_on_ranks(indivisible_heads, 2):
        assert message is not None
        assert "heads=3" in message and "P=2" in message and "multiple of 2" in message


def check_ulysses_dropout(causal, zigzag, tp):
    """Ulysses with dropout equals single-rank attention with the same seed; with tp=2 each tp
    rank passes the global index of its first head."""
    mesh = cached_mesh(sp=torch.distributed.get_world_size() // tp, tp=tp)
    world, seq = mesh.sp_size, 8 * mesh.sp_size
    q, k, v, dout = full_inputs(2, 8, seq, 16, torch.float64, 4)
    shard_zigzag = causal if zigzag is None else zigzag
    mask = make_mask("random", 2, seq, world, shard_zigzag, 4)
    mine = slice(mesh.tp_rank * 8 // tp, (mesh.tp_rank + 1) * 8 // tp)
    expected = single_rank_dropout(q, k, v, dout, mask, causal, heads=mine)
    q, k, v, dout = (t[:, mine].contiguous() for t in (q, k, v, dout))
    actual = parallel_attention(ulysses_attention, q, k, v, dout, mask, causal, mesh.sp_group, shard_zigzag,
                                zigzag=zigzag, dropout_p=DROP_P, dropout_seed=DROP_SEED, head_offset=mine.start)
    compare(actual, expected, torch.float64, f"ulysses dropout sp={world} tp={tp} causal={causal} zigzag={zigzag}")


@pytest.mark.parametrize("world,causal,zigzag,tp", [
    (2, True, None, 1), (4, False, None, 1), (4, True, False, 1), (4, False, True, 1), (4, True, None, 2),
])
def test_ulysses_attention_dropout_matches_single_rank(world, causal, zigzag, tp):
    run_on_ranks(check_ulysses_dropout, world, causal, zigzag, tp)
