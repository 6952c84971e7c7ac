"""RNG streams: dropout masks inside the tensor-parallel region differ per tp rank, masks outside
it are identical on every tp rank and equal serial dropout, forking leaves torch's own stream
untouched. Masks come back to the test process and are compared there.

Nested and re-entered forks, seeds, open forks across threads and checkpoint recomputation of
micro-batches run in the test process: they compare with one serial torch.Generator per stream."""

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.layers.rng_streams import (TP_SEED_OFFSET, ParallelDropout, RNGStreams, dropout, manual_seed, open_forks,
                                         rng_streams, tp_rng)
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


# -- nesting, re-entry, seeds: one process, no ranks needed --------------------------------
# RNGStreams reads only ``tp_rank`` of its mesh (and the device: CPU without a process group)
def lone_mesh(tp_rank=0):
    return SimpleNamespace(tp_rank=tp_rank)


def test_double_fork_equals_serial_generators():
    """Megatron's double fork: A, then B inside it, then A again inside B. The three draws of A,
    the two of B and both final states equal one torch.Generator per stream drawing in turn,
    and torch's own stream is untouched."""
    torch.manual_seed(99)
    outside = torch.get_rng_state()
    streams = RNGStreams(lone_mesh(), 0)
    streams.add("a", 1234)
    streams.add("b", 5678)
    a, b = [], []
    with streams.fork("a"):
        a.append(torch.randn(10))
        with streams.fork("b"):
            b.append(torch.randn(10))
            with streams.fork("a"):
                a.append(torch.randn(10))
            b.append(torch.randn(10))
        a.append(torch.randn(10))
    gen_a, gen_b = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(5678)
    for i, draw in enumerate(a):
        assert torch.equal(draw, torch.randn(10, generator=gen_a)), f"draw {i} of stream a differs from serial"
    for i, draw in enumerate(b):
        assert torch.equal(draw, torch.randn(10, generator=gen_b)), f"draw {i} of stream b differs from serial"
    states = streams.get_states()
    assert torch.equal(states["a"], gen_a.get_state()) and torch.equal(states["b"], gen_b.get_state())
    assert torch.equal(torch.get_rng_state(), outside)
    assert open_forks() == []


def run_program(forks, program, log, current=None):
    """Run a nested program: ("draw", n) draws n numbers into ``log`` under the innermost
    fork's label (``current``; None outside every fork); ("fork", label, body) runs body inside
    ``forks[label]`` (an RNGStreams and a stream name)."""
    for step in program:
        if step[0] == "draw":
            log.append((current, torch.rand(step[1])))
        else:
            streams, name = forks[step[1]]
            with streams.fork(name):
                run_program(forks, step[2], log, step[1])


programs = st.recursive(
    st.tuples(st.just("draw"), st.integers(1, 4)),
    lambda inner: st.tuples(st.just("fork"), st.sampled_from(["tp", "a", "b", "mesh2 tp"]), st.lists(inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None)
@given(program=st.lists(programs, min_size=1, max_size=4), seed=st.integers(0, 2**31))
def test_any_nesting_draws_what_serial_generators_draw(program, seed):
    """Random nesting and re-entry of three streams of one mesh and the tp stream of a second
    mesh: every draw, and every final state, equals one serial torch.Generator per stream (and
    torch's own for the draws outside every fork)."""
    streams, streams2 = RNGStreams(lone_mesh(1), seed), RNGStreams(lone_mesh(0), seed + 7)
    streams.add("a", seed + 1)
    streams.add("b", seed + 2)
    forks = {"tp": (streams, "tp"), "a": (streams, "a"), "b": (streams, "b"), "mesh2 tp": (streams2, "tp")}
    torch.manual_seed(seed)
    log = []
    run_program(forks, program, log)
    seeds = {None: seed, "tp": seed + TP_SEED_OFFSET + 1, "a": seed + 1, "b": seed + 2, "mesh2 tp": seed + 7 + TP_SEED_OFFSET}
    gens = {label: torch.Generator().manual_seed(s) for label, s in seeds.items()}
    for i, (label, draw) in enumerate(log):
        assert torch.equal(draw, torch.rand(len(draw), generator=gens[label])), f"draw {i} ({label}) differs"
    for label, (owner, name) in forks.items():
        assert torch.equal(owner.get_states()[name], gens[label].get_state()), f"final state of {label} differs"
    assert torch.equal(torch.get_rng_state(), gens[None].get_state())


def test_duplicate_seed_and_name_are_refused():
    streams = RNGStreams(lone_mesh(), 10)
    tp_seed = 10 + TP_SEED_OFFSET
    with pytest.raises(ValueError, match=f"stream 'pp' cannot take seed {tp_seed}: stream 'tp' has it"):
        streams.add("pp", tp_seed)
    streams.add("pp", 5)
    with pytest.raises(ValueError, match="stream 'pp' exists already \\(seed 5\\); pass reset=True"):
        streams.add("pp", 6)
    with pytest.raises(ValueError, match="stream 'other' cannot take seed 5: stream 'pp' has it"):
        streams.add("other", 5)
    assert streams.names == ("tp", "pp")
    with pytest.raises(ValueError, match="stream 'pp' cannot take seed .*: stream 'tp' has it"):
        streams.add("pp", tp_seed, reset=True)
    streams.add("pp", 5, reset=True)  # its own seed again: back to the start
    with streams.fork("pp"):
        first = torch.rand(4)
    streams.add("pp", 6, reset=True)
    with streams.fork("pp"):
        assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(6)))
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(5)))


def test_states_of_an_open_fork_live_in_the_generator():
    """Inside a fork, get_states reads the open stream's progress and set_states / add(reset=True)
    move it at once (the generator holds it); re-seeding an outer stream takes effect when the
    inner fork closes."""
    streams = RNGStreams(lone_mesh(), 0)
    streams.add("a", 1)
    gen = torch.Generator().manual_seed(1)
    with streams.fork("a"):
        torch.rand(3)
        gen_after = torch.Generator().set_state(gen.get_state())
        torch.rand(3, generator=gen_after)
        saved = streams.get_states()
        assert torch.equal(saved["a"], gen_after.get_state()), "get_states gave the state from before the fork"
        replay = torch.rand(5)
        streams.set_states(saved)
        assert torch.equal(torch.rand(5), replay), "set_states did not move the open stream"
        streams.add("a", 2, reset=True)
        assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(2)))
        with streams.fork("tp"):
            streams.add("a", 3, reset=True)
        assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(3)))


def test_forks_closed_out_of_order_raise():
    streams = RNGStreams(lone_mesh(), 0)
    streams.add("a", 1)
    outer, inner = streams.fork("a"), streams.fork("tp")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match=r"fork\('a'\) closed while fork\('tp'\), opened after it, is still open"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert open_forks() == []


def test_manual_seed_inside_a_fork_raises():
    mesh = lone_mesh()
    with rng_streams(mesh).fork("tp"):
        with pytest.raises(RuntimeError, match=r"manual_seed\(mesh, 4\) called inside an open fork of RNG stream 'tp'"):
            manual_seed(mesh, 4)
    assert open_forks() == []


def test_fork_nests_across_threads():
    """Autograd may run a recomputation on its own thread while the forward thread waits
    inside a fork: the open forks belong to the generator, so that nests like one thread."""
    streams = RNGStreams(lone_mesh(), 0)
    streams.add("a", 1)
    streams.add("b", 2)
    drawn = {}

    def other_thread():
        with streams.fork("b"):
            drawn["b"] = torch.rand(3)
            with streams.fork("a"):
                drawn["a1"] = torch.rand(3)

    with streams.fork("a"):
        drawn["a0"] = torch.rand(3)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        drawn["a2"] = torch.rand(3)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    for key in ("a0", "a1", "a2"):
        assert torch.equal(drawn[key], torch.rand(3, generator=gen_a)), key
    assert torch.equal(drawn["b"], torch.rand(3, generator=gen_b))


def microbatches_under_checkpoint(user_fork, backward_inside, checkpointed):
    """Two micro-batches through a dropout block (forward 0, forward 1, backward 0, backward 1,
    as a pipeline schedule interleaves them), optionally inside the user's own fork of the tp
    stream, with or without checkpointing: masks, input-gradient masks, what the user's stream
    draws next and the stream's final state."""
    from torch.utils.checkpoint import checkpoint

    from shardzoo.layers.recompute import stream_contexts

    mesh = lone_mesh(1)
    manual_seed(mesh, 11)

    def block(x):
        return dropout(x, 0.5, mesh=mesh)  # forks the tp stream, nested in the user's fork if any

    def run(x):
        if checkpointed:
            return checkpoint(block, x, use_reentrant=False, context_fn=lambda: stream_contexts(mesh))
        return block(x)

    xs = [torch.ones(SHAPE, requires_grad=True) for _ in range(2)]
    with tp_rng(mesh) if user_fork else contextlib.nullcontext():
        first = torch.rand(3)
        ys = [run(x) for x in xs]
        if backward_inside:
            for y in ys:
                y.sum().backward()
        after = torch.rand(3)
    if not backward_inside:
        for y in ys:
            y.sum().backward()
    return ([first, after, rng_streams(mesh).get_states()["tp"]] + [y.detach() != 0 for y in ys]
            + [x.grad != 0 for x in xs])


@pytest.mark.parametrize("user_fork,backward_inside", [(False, False), (True, False), (True, True)])
def test_checkpointed_microbatches_replay_their_masks(user_fork, backward_inside):
    """The recomputation replays each micro-batch's masks and leaves every stream as the plain
    run does, also inside a user's fork of the same stream (backward inside it or after)."""
    plain = microbatches_under_checkpoint(user_fork, backward_inside, False)
    ckpt = microbatches_under_checkpoint(user_fork, backward_inside, True)
    what = ["user's first draw", "user's next draw", "final tp state", "mask 0", "mask 1", "grad mask 0", "grad mask 1"]
    for name, p, c in zip(what, plain, ckpt):
        assert torch.equal(p, c), f"{name} differs under checkpointing"
    assert torch.equal(plain[3], plain[5]) and torch.equal(plain[4], plain[6])
    assert not torch.equal(plain[3], plain[4]), "the two micro-batches drew the same mask"
    # serially: the tp stream draws the user's numbers and both masks in turn
    torch.manual_seed(11 + TP_SEED_OFFSET + 1)
    first = torch.rand(3) if user_fork else None
    masks = [F.dropout(torch.ones(SHAPE), 0.5) != 0 for _ in range(2)]
    if user_fork:
        assert torch.equal(plain[0], first)
        assert torch.equal(plain[1], torch.rand(3))
    assert torch.equal(plain[2], torch.get_rng_state())
    assert torch.equal(plain[3], masks[0]) and torch.equal(plain[4], masks[1])
