"""Ring attention against serial SDPA on the full sequence: outputs and dq / dk / dv.

Every rank builds the full q, k, v, padding mask and output gradient from the seed, computes
the fp64 reference with ``F.scaled_dot_product_attention`` (explicit boolean mask), then shards
the inputs (zigzag when causal), runs ring attention over the sp group and gathers the output;
input gradients arrive full-size through ``shard_sequence``'s backward."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardzoo import comm
from shardzoo.layers.ring_attention import merge_block, ring_attention
from shardzoo.layers.sequence import shard_padding_mask, shard_sequence
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.sequence_attention import (DROP_P, DROP_SEED, DTYPES, MASK_KINDS, compare, full_inputs, make_mask,
                                                 parallel_attention, reference_grads, single_rank_dropout)


def check_ring(case):
    world = torch.distributed.get_world_size()
    batch, heads, seq, head_dim, causal, mask_kind, dtype_name, seed = case
    dtype = DTYPES[dtype_name]
    group = cached_mesh(sp=world).sp_group
    q, k, v, dout = full_inputs(batch, heads, seq, head_dim, dtype, seed)
    mask = make_mask(mask_kind, batch, seq, world, causal, seed)
    expected = reference_grads(q, k, v, dout, mask, causal)
    actual = parallel_attention(ring_attention, q, k, v, dout, mask, causal, group)
    compare(actual, expected, dtype, f"ring sp={world} case={case}")


@st.composite
def attention_case(draw, world):
    causal = draw(st.booleans())
    seq = 2 * world * draw(st.integers(1, 4)) if causal else world * draw(st.integers(1, 8))
    return (
        draw(st.integers(1, 2)),  # batch
        draw(st.integers(1, 3)),  # heads
        seq,
        draw(st.sampled_from([16, 24, 32, 64])),  # head_dim
        causal,
        draw(st.sampled_from(MASK_KINDS)),
        draw(st.sampled_from(["fp32", "fp64"])),
        draw(st.integers(0, 10**6)),
    )


@pytest.mark.parametrize("world", [1, 2, 4])
@given(data=st.data())
def test_ring_attention_matches_sdpa(world, data):
    run_on_ranks(check_ring, world, data.draw(attention_case(world)))


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_long_sequence_fixed_example(causal):
    """Local shards longer than the kernel's key chunk (256), padding on one whole shard."""
    run_on_ranks(check_ring, 2, (1, 2, 1024, 32, causal, "rank_padded", "fp32", 7))


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_bf16(causal):
    run_on_ranks(check_ring, 4, (2, 2, 64, 32, causal, "random", "bf16", 11))


def check_ring_with_tp(causal, seed):
    """tp=2 x sp=2: each tp rank takes half the heads, ring attention runs over the sp group."""
    mesh = cached_mesh(sp=2, tp=2)
    heads, seq = 4, 16
    q, k, v, dout = full_inputs(2, heads, seq, 16, torch.float32, seed)
    mask = make_mask("random", 2, seq, 2, causal, seed)
    per_tp = heads // mesh.tp_size
    mine = slice(mesh.tp_rank * per_tp, (mesh.tp_rank + 1) * per_tp)
    q, k, v, dout = (t[:, mine].contiguous() for t in (q, k, v, dout))
    expected = reference_grads(q, k, v, dout, mask, causal)
    actual = parallel_attention(ring_attention, q, k, v, dout, mask, causal, mesh.sp_group)
    compare(actual, expected, torch.float32, f"ring tp=2 sp=2 rank {mesh.rank()}")


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_with_tensor_parallel_heads(causal):
    run_on_ranks(check_ring_with_tp, 4, causal, 3)


def count_ring_bytes(causal, with_mask):
    """Bytes this rank sends in forward and in backward."""
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v = (torch.randn(2, 3, 8, 16, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 8) > 0.2 if with_mask else None
    with comm.count() as forward:
        out = ring_attention(q, k, v, group=group, causal=causal, key_padding_mask=mask)
    with comm.count() as backward:
        out.sum().backward()
    kv_bytes = 2 * k.numel() * k.element_size() + (mask.numel() if with_mask else 0)
    grad_bytes = 2 * k.numel() * 4  # dK, dV travel in fp32
    return forward.bytes.get("send", 0), backward.bytes.get("send", 0), kv_bytes, grad_bytes, world


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal,with_mask", [(False, False), (True, True)])
def test_ring_attention_sends_exact_bytes(world, causal, with_mask):
    """Forward: (P-1) hops of K + V (+ mask); backward: the same again plus P hops of dK + dV."""
    for fwd, bwd, kv_bytes, grad_bytes, p in run_on_ranks(count_ring_bytes, world, causal, with_mask):
        assert fwd == (p - 1) * kv_bytes
        assert bwd == (p - 1) * kv_bytes + p * grad_bytes


def test_merge_block_equals_attention_over_concatenated_keys():
    """Serial: merging two key blocks = one block over both, including rows empty on one side."""
    g = torch.Generator().manual_seed(0)
    from shardzoo.kernels import attention_block_forward

    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 6, generator=g) > 0.4
    mask[0, :3] = False  # rows of batch 0 see nothing in the first block
    mask[1] = False  # batch 1 sees nothing at all
    full_out, full_lse = attention_block_forward(q, k, v, key_padding_mask=mask)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    for cols in (slice(0, 3), slice(3, 6)):
        block_out, block_lse = attention_block_forward(q, k[:, :, cols], v[:, :, cols], key_padding_mask=mask[:, cols])
        merge_block(out, lse, block_out, block_lse)
    assert_close(out, full_out, "merged out", terms=TINY_MODEL_TERMS)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    finite = torch.isfinite(full_lse)
    assert_close(lse[finite], full_lse[finite], "merged lse", terms=TINY_MODEL_TERMS)
    assert not out.isnan().any()


def odd_causal_shard():
    q = torch.randn(1, 2, 5, 8)
    try:
        ring_attention(q, q, q, group=cached_mesh(sp=2).sp_group, causal=True)
    except ValueError as e:
        return str(e)
    return None


def test_ring_attention_odd_causal_shard_raises_clear_error():
    for message in run_on_ranks(odd_causal_shard, 2):
        assert message is not None and "5 is odd" in message and "zigzag=True" in message


def test_ring_attention_bad_mask_raises_clear_error():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"bool \[batch, seq/P\]"):
        ring_attention(q, q, q, group=None, key_padding_mask=torch.ones(1, 4))


def check_ring_triton_kernels(causal):
    """The ring with the Triton block kernels against the torch reference kernels (same inputs)."""
    from shardzoo.layers.ring_attention import RingAttentionFunction, RingSettings

    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v, dout = full_inputs(1, 2, 16 * world, 16, torch.float32, 21)
    mask = make_mask("rank_padded", 1, 16 * world, world, causal, 1)
    local = [shard_sequence(t, group, dim=2, zigzag=causal) for t in (q, k, v, dout)]
    local_mask = shard_padding_mask(mask, group, zigzag=causal)
    for dropout_p in (0.0, DROP_P):  # with dropout: the same mask from both kernels
        results = {}
        for backend in ("torch", "triton"):
            leaves = [t.clone().requires_grad_(True) for t in local[:3]]
            settings = RingSettings(group, causal, None, backend, dropout_p=dropout_p, dropout_seed=DROP_SEED,
                                    zigzag=causal)
            out = RingAttentionFunction.apply(*leaves, local_mask, settings)
            out.backward(local[3])
            results[backend] = (out.detach(), *(t.grad for t in leaves))
        for name, a, e in zip(("out", "dq", "dk", "dv"), results["triton"], results["torch"]):
            assert_close(a, e, f"triton vs torch block kernel in the ring (p={dropout_p}): {name}",
                         terms=TINY_MODEL_TERMS)


def test_ring_attention_with_triton_block_kernels():
    """Under the Triton CPU interpreter, which must be on before the workers import triton."""
    import os

    from shardzoo.comm import WorkerPool

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = WorkerPool(2)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    with pool:
        pool.run(check_ring_triton_kernels, True)  # causal: diagonal, full and half blocks


def check_ring_dropout(causal):
    """Ring attention with dropout equals single-rank attention with the same seed (same mask)."""
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v, dout = full_inputs(2, 3, 8 * world, 16, torch.float64, 5)
    mask = make_mask("random", 2, 8 * world, world, causal, 5)
    expected = single_rank_dropout(q, k, v, dout, mask, causal)
    actual = parallel_attention(ring_attention, q, k, v, dout, mask, causal, group, dropout_p=DROP_P,
                                dropout_seed=DROP_SEED)
    compare(actual, expected, torch.float64, f"ring dropout sp={world} causal={causal}")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_dropout_matches_single_rank(world, causal):
    run_on_ranks(check_ring_dropout, world, causal)


def check_ring_dropout_with_tp(causal):
    """tp=2 x sp=2: a tp rank's heads start at head_offset, so its mask is the serial one."""
    mesh = cached_mesh(sp=2, tp=2)
    q, k, v, dout = full_inputs(2, 4, 16, 16, torch.float64, 9)
    mask = make_mask("random", 2, 16, 2, causal, 9)
    mine = slice(mesh.tp_rank * 2, mesh.tp_rank * 2 + 2)
    expected = single_rank_dropout(q, k, v, dout, mask, causal, heads=mine)
    q, k, v, dout = (t[:, mine].contiguous() for t in (q, k, v, dout))
    actual = parallel_attention(ring_attention, q, k, v, dout, mask, causal, mesh.sp_group, dropout_p=DROP_P,
                                dropout_seed=DROP_SEED, head_offset=mine.start)
    compare(actual, expected, torch.float64, f"ring dropout tp=2 sp=2 rank {mesh.rank()}")


def test_ring_attention_dropout_with_tensor_parallel_heads():
    run_on_ranks(check_ring_dropout_with_tp, 4, True)


@pytest.mark.parametrize("causal,q_len,k_len", [(False, 8, 8), (False, 5, 9), (False, 1, 3), (True, 8, 8),
                                                 (True, 7, 7), (True, 1, 1)])  # causal blocks are square
@pytest.mark.parametrize("row_tile", [None, 1, 2, 3, 5])
def test_tile_rect_covers_each_visible_pair_once(causal, q_len, k_len, row_tile):
    """Kernel calls cut from a visible block, whole or restricted to a key chunk, partition its
    visible (query, key) pairs and visit nothing above a causal diagonal."""
    from shardzoo.layers.packing import tile_rect

    for chunk in (None, (-3, 1), (1, 4), (2, k_len), (k_len - 1, k_len + 3)):  # keys relative to the block
        cols = None if chunk is None else (3 + chunk[0], 3 + chunk[1])
        covered = torch.zeros(q_len + 2, k_len + 3, dtype=torch.int64)
        for r0, r1, c0, c1, diag in tile_rect((2, 2 + q_len, 3, 3 + k_len, causal), row_tile, cols):
            assert r1 - r0 <= (row_tile or q_len) and (not diag or r1 - r0 == c1 - c0)
            piece = torch.ones(r1 - r0, c1 - c0, dtype=torch.int64)
            covered[r0 - 2 : r1 - 2, c0 : c1] += piece.tril() if diag else piece
        expected = torch.zeros_like(covered)
        block = torch.ones(q_len, k_len, dtype=torch.int64)
        expected[:q_len, 3:] = block.tril() if causal else block
        if cols is not None:
            keep = torch.zeros(k_len + 3, dtype=torch.bool)
            keep[cols[0] : cols[1]] = True
            expected[:, ~keep] = 0
        assert torch.equal(covered, expected), cols


def check_gradient_schedules(causal, grad_tiles, backend, dropout_p=0.0):
    """A dK / dV schedule of ring_backward on a CPU kernel, tiles down to one row / key, against
    the fp64 reference (with dropout: single-rank attention with the same seed, so each tile
    must take its slice of the global positions)."""
    from shardzoo.layers.ring_attention import RingAttentionFunction, RingSettings

    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v, dout = full_inputs(2, 2, 12 * world, 16, torch.float64, 17)
    mask = make_mask("random", 2, 12 * world, world, causal, 17)
    if dropout_p:
        expected = single_rank_dropout(q, k, v, dout, mask, causal)
    else:
        expected = reference_grads(q, k, v, dout, mask, causal)

    def attention(q, k, v, group, causal, key_padding_mask):
        settings = RingSettings(group, causal, None, backend, dropout_p=dropout_p, dropout_seed=DROP_SEED,
                                zigzag=causal, grad_tiles=grad_tiles, min_tile=1)
        return RingAttentionFunction.apply(q, k, v, key_padding_mask, settings)

    actual = parallel_attention(attention, q, k, v, dout, mask, causal, group)
    compare(actual, expected, torch.float64, f"ring grad_tiles={grad_tiles} {backend} p={dropout_p} sp={world}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad_tiles,backend", [(0, "torch"), (0, "aten"), (3, "torch"), (5, "aten")])
def test_ring_attention_gradient_schedules(world, causal, grad_tiles, backend):
    """grad_tiles=0 is the CUDA schedule (overlapped dK / dV hops), n > 0 the CPU one (tiles)."""
    run_on_ranks(check_gradient_schedules, world, causal, grad_tiles, backend)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_dropout_in_tiles_matches_single_rank(world, causal):
    run_on_ranks(check_gradient_schedules, world, causal, 3, "torch", DROP_P)


def count_backward_kernel_rows_and_keys():
    """(most query rows, most keys) of one backward kernel call, and the local length, on this rank."""
    import sys

    ring = sys.modules["shardzoo.layers.ring_backward"]
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v = (torch.randn(1, 1, 4096, 16, requires_grad=True) for _ in range(3))  # long enough for 4 tiles
    out = ring_attention(q, k, v, group=group, causal=True)
    seen, original = [], ring.attention_block_backward
    ring.attention_block_backward = lambda *a, **kw: seen.append((a[1].shape[2], a[2].shape[2])) or original(*a, **kw)
    try:
        out.sum().backward()
    finally:
        ring.attention_block_backward = original
    return max(s[0] for s in seen), max(s[1] for s in seen), k.shape[2]


def test_ring_attention_cpu_backward_asks_the_kernel_for_tiles_only():
    """On CPU no long block's gradients come from one kernel call: at most 1/CPU_GRAD_TILES of the
    keys and queries per call (or min_tile), so the tile outputs stay small next to q, k, v."""
    from shardzoo.layers.ring_attention import CPU_GRAD_TILES, RingSettings

    for max_rows, max_keys, local in run_on_ranks(count_backward_kernel_rows_and_keys, 2):
        tile = max(RingSettings(None, True, None).min_tile, -(-local // CPU_GRAD_TILES))
        assert tile < local and max_keys <= tile and max_rows <= tile


def check_public_schedule(causal):
    """``ring_attention(..., grad_tiles=0)`` (whole blocks) on CPU tensors equals the fp64
    reference as the default chunked schedule does; a negative count is refused."""
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    q, k, v, dout = full_inputs(1, 2, 8 * world, 8, torch.float64, 3)
    expected = reference_grads(q, k, v, dout, None, causal)
    for tiles in (0, 2):
        actual = parallel_attention(ring_attention, q, k, v, dout, None, causal, group, grad_tiles=tiles)
        compare(actual, expected, torch.float64, f"ring_attention(grad_tiles={tiles}) sp={world}")
    with pytest.raises(ValueError, match="grad_tiles=-1 must be an int >= 0"):
        ring_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], group=group, grad_tiles=-1)


def test_ring_attention_schedule_is_a_keyword():
    run_on_ranks(check_public_schedule, 2, True)
