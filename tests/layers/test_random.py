"""RNG streams: dropout masks inside the tensor-parallel region differ per tp rank, masks outside
it are identical on every tp rank and equal serial dropout, forking leaves torch's own stream
untouched. Masks come back to the test process and are compared there."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.layers.random import TP_SEED_OFFSET, ParallelDropout, RNGStreams, dropout, manual_seed, tp_rng
from shardzoo.testing import cached_mesh, run_on_ranks

SHAPE = (4, 8, 32)  # 1024 elements: two independent masks agree with probability ~2**-1024


def draw_masks(layout, seed, p):
    """(in-region mask, out-of-region mask, serial-dropout mask, next default draw, tp rank)."""
    mesh = cached_mesh(**layout)
    x = torch.ones(SHAPE)
    manual_seed(mesh, seed)
    inside = dropout(x, p, mesh=mesh, parallel_region=True) != 0
    outside = ParallelDropout(p, mesh=mesh, parallel_region=False)(x) != 0
    after = torch.rand(3)  # forking must not have advanced or replaced torch's own stream
    torch.manual_seed(seed)
    serial = F.dropout(x, p) != 0
    expected_after = torch.rand(3)
    return inside, outside, serial, torch.equal(after, expected_after), mesh.tp_rank


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=5)
@given(seed=st.integers(0, 2**31), p=st.sampled_from([0.1, 0.5, 0.9]))
def test_masks_inside_differ_outside_agree(tp, seed, p):
    results = run_on_ranks(draw_masks, tp, {"tp": tp}, seed, p)
    insides = [r[0] for r in results]
    for rank, (inside, outside, serial, untouched, _) in enumerate(results):
        assert untouched, "tp dropout changed torch's default RNG stream"
        assert torch.equal(outside, results[0][1]), f"out-of-region mask on tp rank {rank} differs from rank 0"
        assert torch.equal(outside, serial), "out-of-region mask differs from serial F.dropout with the same seed"
    for a in range(tp):
        for b in range(a + 1, tp):
            assert not torch.equal(insides[a], insides[b]), f"in-region masks of tp ranks {a} and {b} are equal"


def test_tp1_in_region_is_serial_dropout_of_offset_seed():
    """Documented: with tp = 1 the in-region mask is F.dropout after manual_seed(seed + TP_SEED_OFFSET)."""
    inside = run_on_ranks(draw_masks, 1, {"tp": 1}, 123, 0.5)[0][0]
    torch.manual_seed(123 + TP_SEED_OFFSET)
    assert torch.equal(inside, F.dropout(torch.ones(SHAPE), 0.5) != 0)


def test_tp_stream_depends_on_tp_rank_only():
    """dp=2 x tp=2: ranks with the same tp rank draw the same in-region mask (Megatron's seeding)."""
    results = run_on_ranks(draw_masks, 4, {"dp": 2, "tp": 2}, 5, 0.5)
    by_tp = {}
    for inside, *_, tp_rank in results:
        by_tp.setdefault(tp_rank, []).append(inside)
    for masks in by_tp.values():
        assert torch.equal(masks[0], masks[1])
    assert not torch.equal(by_tp[0][0], by_tp[1][0])


def stream_state_roundtrip():
    mesh = cached_mesh(tp=2)
    streams = RNGStreams(mesh, 77)
    saved = streams.get_states()
    with streams.fork():
        first = torch.rand(5)
    with streams.fork():
        second = torch.rand(5)
    streams.set_states(saved)
    with streams.fork("tp"):
        replay = torch.rand(5)
    manual_seed(mesh, 9)
    with tp_rng(mesh):
        via_context = torch.rand(5)
    return not torch.equal(first, second), torch.equal(first, replay), via_context


def test_stream_advances_and_restores():
    results = run_on_ranks(stream_state_roundtrip, 2)
    for advanced, replayed, _ in results:
        assert advanced and replayed
    assert not torch.equal(results[0][2], results[1][2])


def test_eval_mode_and_errors():
    layer = ParallelDropout(0.5, mesh=None)
    layer.eval()
    x = torch.randn(3, 4)
    assert layer(x) is x
    with pytest.raises(ValueError, match=r"p=1.5 must be in \[0, 1\]"):
        ParallelDropout(1.5, mesh=None)
    with pytest.raises(KeyError, match="no RNG stream named 'pp'"):
        streams = RNGStreams.__new__(RNGStreams)
        streams._states = {"tp": torch.get_rng_state()}
        streams.device = torch.device("cpu")
        with streams.fork("pp"):
            pass
