"""A causal sliding window (transformers' ``sliding_window``: query i sees the keys j with
i - window < j <= i) in ring attention and Ulysses, against serial SDPA with the window mask;
and the ring's skipping of the (query chunk, key chunk) pairs wholly outside the window."""

import pytest
import torch

from shardzoo.layers import ring_backward, ring_core
from shardzoo.layers.ring_attention import ring_attention
from shardzoo.layers.ulysses import ulysses_attention
from shardzoo.testing import cached_mesh, run_on_ranks
from support.sequence_attention import (DTYPES, compare, full_inputs, make_mask, parallel_attention,
                                                 reference_grads)

CHUNK = 4  # tokens per zigzag chunk: the sequence is 2P chunks, a rank holds 2 (its block)


def windows(world: int) -> dict[str, int]:
    """Windows shorter than a chunk, equal to a chunk, equal to a rank's block, and longer than
    the sequence."""
    seq = 2 * world * CHUNK
    return {"below-chunk": CHUNK - 1, "one": 1, "chunk": CHUNK, "block": 2 * CHUNK, "beyond-seq": seq + 3}


def check_window(attention, dtype_name, mask_kind, seed):
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    dtype, seq = DTYPES[dtype_name], 2 * world * CHUNK
    q, k, v, dout = full_inputs(2, world, seq, 16, dtype, seed)
    mask = make_mask(mask_kind, 2, seq, world, True, seed)
    for name, window in windows(world).items():
        expected = reference_grads(q, k, v, dout, mask, True, window=window)
        actual = parallel_attention(attention, q, k, v, dout, mask, True, group, window=window)
        compare(actual, expected, dtype, f"{attention.__name__} sp={world} window={window} ({name}) {mask_kind}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name,mask_kind", [("fp32", "random"), ("fp64", "none")])
def test_ring_window_equals_sdpa(world, dtype_name, mask_kind):
    run_on_ranks(check_window, world, ring_attention, dtype_name, mask_kind, 5)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name,mask_kind", [("fp32", "random"), ("fp64", "none")])
def test_ulysses_window_equals_sdpa(world, dtype_name, mask_kind):
    run_on_ranks(check_window, world, ulysses_attention, dtype_name, mask_kind, 6)


def count_calls(window, grad_tiles):
    """(forward kernel calls, backward kernel calls, (query chunk, key chunk) pairs of this
    rank that the causal window leaves a visible key in, causal pairs without the window)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    group = cached_mesh(sp=world).sp_group
    q, k, v = (torch.randn(1, 2, 2 * CHUNK, 8, requires_grad=True) for _ in range(3))
    calls = {"forward": 0, "backward": 0}
    forward, backward = ring_core.attention_block_forward, ring_backward.attention_block_backward

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    ring_core.attention_block_forward = counted("forward", forward)
    ring_backward.attention_block_backward = counted("backward", backward)
    try:
        ring_attention(q, k, v, group=group, causal=True, window=window, grad_tiles=grad_tiles).sum().backward()
    finally:
        ring_core.attention_block_forward, ring_backward.attention_block_backward = forward, backward

    def seen(a, b, w):  # any query of chunk a sees a key of chunk b
        return any(i - w < j <= i for i in range(a * CHUNK, (a + 1) * CHUNK) for j in range(b * CHUNK, (b + 1) * CHUNK))

    mine = (rank, 2 * world - 1 - rank)  # zigzag chunks
    pairs = sum(seen(a, b, window) for a in mine for b in range(2 * world))
    causal_pairs = sum(seen(a, b, 2 * world * CHUNK) for a in mine for b in range(2 * world))
    return calls["forward"], calls["backward"], pairs, causal_pairs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("grad_tiles", [0, None])
def test_ring_window_skips_blocks_outside_it(world, grad_tiles):
    """One kernel call per (query chunk, key chunk) pair the window intersects, forward and
    backward; a window shorter than a chunk skips most of the causal pairs."""
    for window in (1, CHUNK - 1, CHUNK, CHUNK + 1):
        results = run_on_ranks(count_calls, world, window, grad_tiles)
        for rank, (fwd, bwd, pairs, causal_pairs) in enumerate(results):
            assert fwd == bwd == pairs, f"sp={world} rank {rank} window={window}: {fwd} forward and {bwd} " \
                                        f"backward kernel calls for {pairs} chunk pairs inside the window"
        if window < CHUNK:
            assert sum(r[2] for r in results) < sum(r[3] for r in results)
