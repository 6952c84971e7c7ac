"""The time model's two CPU-host rules (docs/planner.md, "Time"): elementwise work over tensors
larger than a cache is priced at the large-tensor bandwidth, and with more ranks than cores a
pipeline's bubble leaves its cores to the busy ranks."""

import dataclasses
from types import SimpleNamespace

import pytest

from shardzoo.layers.block_costs import HUGE_BYTES, LARGE_BYTES, Piece, elementwise
from shardzoo.planner.evaluate import stage_kind_counts
from shardzoo.planner.model import StageCost
from shardzoo.planner.presets import HARDWARE
from shardzoo.planner.time import compute_seconds, step_seconds


def test_elementwise_work_over_a_large_tensor_is_counted_apart():
    small, large = LARGE_BYTES // 4, LARGE_BYTES // 4 + 1  # fp32 elements: at and just past the threshold
    assert elementwise(3, small, 4) == {"elems": 3 * small, "big_elems": 0, "huge_elems": 0}
    assert elementwise(3, large, 4) == {"elems": 3 * large, "big_elems": 3 * large, "huge_elems": 0}
    assert (Piece(**elementwise(2, small, 4)) + Piece(**elementwise(5, large, 4))).big_elems == 5 * large
    below, huge = HUGE_BYTES // 4 - 1, HUGE_BYTES // 4  # past glibc's largest heap block: mapped afresh
    assert elementwise(1, below, 4)["huge_elems"] == 0
    assert elementwise(2, huge, 4) == {"elems": 2 * huge, "big_elems": 2 * huge, "huge_elems": 2 * huge}
    assert (Piece(**elementwise(1, large, 4)) + Piece(**elementwise(2, huge, 4))).huge_elems == 2 * huge


def test_large_tensors_are_priced_at_the_large_bandwidth():
    n = LARGE_BYTES  # elements; 4 bytes each: a large tensor
    block = [Piece(**elementwise(1, 8, 4))]
    stage = StageCost(first=Piece(**elementwise(2, n, 4)), block=block, blocks=1, last=Piece(), boundary=0, tied_table=0)
    hw = HARDWARE["a100"]
    assert hw.large_elementwise_bandwidth == hw.elementwise_bandwidth  # unset: one bandwidth for every size
    slow = dataclasses.replace(hw, large_elementwise_bandwidth=hw.elementwise_bandwidth / 4)
    extra = compute_seconds(stage, False, slow, 4) - compute_seconds(stage, False, hw, 4)
    expected = 2 * 4 * 2 * n * (1 / slow.large_elementwise_bandwidth - 1 / hw.elementwise_bandwidth)
    assert extra == pytest.approx(expected, rel=1e-9)
    assert hw.huge_elementwise_bandwidth == hw.large_elementwise_bandwidth  # unset: as large tensors


def test_huge_tensors_are_priced_at_the_huge_bandwidth():
    n = HUGE_BYTES // 4  # fp32 elements: a huge tensor, mapped afresh on every use
    stage = StageCost(first=Piece(**elementwise(3, n, 4)), block=[Piece()], blocks=1, last=Piece(), boundary=0,
                      tied_table=0)
    hw = dataclasses.replace(HARDWARE["a100"], large_elementwise_bandwidth=2e12, huge_elementwise_bandwidth=1e12)
    assert compute_seconds(stage, False, hw, 4) == pytest.approx(2 * 4 * 3 * n / 1e12, rel=1e-9)


@pytest.mark.parametrize("share, expected", [(1.0, 5.0), (0.5, 4.0), (0.25, 4.0), (0.9, 4.5)])
def test_the_bubble_of_an_oversubscribed_host_is_lent_to_the_busy_ranks(share, expected):
    """pp=2, 4 micro-batches of 1 s each at the shared speed: (m + pp - 1) = 5 s with a core per
    rank; time-shared, max(m, (m + pp - 1) * max(share, 1 / pp)) s."""
    layout = SimpleNamespace(micro_batches=4, pp=2)
    reports = [SimpleNamespace(micro_seconds=1.0, step_seconds=0.0, share=share, stages_alike=1)] * 2
    assert step_seconds(layout, reports) == pytest.approx(expected)


def test_a_time_shared_pipeline_is_priced_by_its_mean_stage_and_its_critical_path():
    """pp=4 on 4 ranks of 2 cores (share 0.5), 8 micro-batches: stage 0 (1 s), two middle
    stages (1 s each, one report standing for both) and a heavy last stage (5 s). The work is
    m * mean = 8 * 8 / 4 = 16 s; the critical path runs each stage on a whole core (half its
    shared time): 7 * 2.5 + (0.5 + 2 * 0.5 + 2.5) = 21.5 s, the larger. With 16 ranks the stage
    can use at most the 2 cores (share 1/8, each stage at a quarter of its shared time)."""
    def reports(share):
        return [SimpleNamespace(micro_seconds=t, step_seconds=0.0, share=share, stages_alike=n)
                for t, n in ((1.0, 1), (1.0, 2), (5.0, 1))]

    assert step_seconds(SimpleNamespace(micro_batches=8, pp=4), reports(0.5)) == pytest.approx(21.5)
    assert step_seconds(SimpleNamespace(micro_batches=8, pp=4), reports(0.125)) == pytest.approx(
        max(16.0, 7 * 1.25 + 0.25 + 0.5 + 1.25))
    # a core per rank: the heavy stage's 8 micro-batches, one through each other stage
    assert step_seconds(SimpleNamespace(micro_batches=8, pp=4), reports(1.0)) == pytest.approx(7 * 5 + 1 + 2 + 5)
    assert stage_kind_counts(4, 4) == {0: 1, 1: 2, 3: 1}
    assert stage_kind_counts(7, 4) == {0: 1, 1: 2, 3: 1}  # 2, 2, 2, 1 blocks
    assert stage_kind_counts(6, 4) == {0: 1, 1: 1, 2: 1, 3: 1}  # 2, 2, 1, 1 blocks
    assert stage_kind_counts(5, 1) == {0: 1}


def test_a_message_on_an_oversubscribed_host_costs_the_measured_shared_latency():
    """Latency per message through the calibrated points (1, link), (2, 2x), (4, 4x) ranks per
    core, along the last slope beyond; unmeasured hosts scale the link latency by ranks / cores."""
    hw = dataclasses.replace(HARDWARE["a100"], cores_per_node=2, shared_latency_2x=1e-3, shared_latency_4x=3e-3)
    link = 1e-4
    assert hw.message_latency(link, 1) == link and hw.message_latency(link, 2) == link  # a core each
    assert hw.message_latency(link, 3) == pytest.approx(link + 0.5 * (1e-3 - link))
    assert hw.message_latency(link, 4) == pytest.approx(1e-3)
    assert hw.message_latency(link, 6) == pytest.approx(2e-3)
    assert hw.message_latency(link, 8) == pytest.approx(3e-3)
    assert hw.message_latency(link, 16) == pytest.approx(7e-3)
    unmeasured = dataclasses.replace(hw, shared_latency_2x=0.0, shared_latency_4x=0.0)
    assert unmeasured.message_latency(link, 8) == pytest.approx(4 * link)
    assert HARDWARE["a100"].message_latency(link, 8) == link  # accelerators: one device per rank


def test_the_wait_for_a_core_grows_with_the_compute_between_messages():
    """Between the figures calibrated after a short and a long matmul the latency is linear in
    the chunk, held at the nearer figure outside; without the long figures the short ones serve."""
    hw = dataclasses.replace(HARDWARE["a100"], cores_per_node=2, shared_latency_2x=1e-3, shared_latency_4x=3e-3,
                             shared_chunk=2e-3, shared_latency_2x_long=5e-3, shared_latency_4x_long=7e-3,
                             shared_chunk_long=20e-3)
    link = 1e-4
    assert hw.message_latency(link, 4, chunk=0.0) == pytest.approx(1e-3)
    assert hw.message_latency(link, 4, chunk=11e-3) == pytest.approx(3e-3)  # halfway
    assert hw.message_latency(link, 4, chunk=1.0) == pytest.approx(5e-3)
    assert hw.message_latency(link, 8, chunk=20e-3) == pytest.approx(7e-3)
    assert hw.message_latency(link, 2, chunk=1.0) == link  # a core each: no wait
    short_only = dataclasses.replace(hw, shared_latency_2x_long=0.0, shared_latency_4x_long=0.0)
    assert short_only.message_latency(link, 4, chunk=1.0) == pytest.approx(1e-3)


def test_a_broadcast_waits_for_the_rounds_of_a_binomial_tree():
    """Messages (latency terms) per call: a ring for the byte-model collectives, ceil(log2 p)
    rounds for a broadcast; its bytes stay the ring's."""
    from shardzoo.layers.block_costs import calls
    from shardzoo.planner.comm import Traffic

    for p, rounds in ((2, 1), (3, 2), (4, 2), (8, 3), (9, 4)):
        [(_, _, messages)] = Traffic().add(calls("fwd", ("tp",), "broadcast", 1024, p)).links()
        assert messages == rounds
    [(_, _, messages)] = Traffic().add(calls("fwd", ("tp",), "all_reduce", 1024, 8)).links()
    assert messages == 14
