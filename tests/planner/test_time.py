"""The time model's host rules (docs/planner.md, "Time" and "Host models"): on a time-shared CPU
host elementwise work over tensors larger than a cache (or than glibc's largest heap block) is
priced at its own bandwidth, a pipeline's bubble leaves its cores to the busy ranks and a
message waits for a core; accelerator presets have none of it. Broadcasts wait for the
messages their backend sends."""

import dataclasses
from types import SimpleNamespace

import pytest

from shardzoo.planner.block_costs import Piece, calls, elementwise
from shardzoo.planner.comm import Traffic
from shardzoo.planner.evaluate import stage_kind_counts
from shardzoo.planner.host import DEDICATED
from shardzoo.planner.host_cpu import CACHE_BYTES, MMAP_THRESHOLD_BYTES, TimeSharedCpu
from shardzoo.planner.model import StageCost
from shardzoo.planner.presets import HARDWARE
from shardzoo.planner.time import Links, compute_seconds, step_seconds

CPU = TimeSharedCpu(cores=2)


def test_the_layers_state_bytes_and_the_host_model_classes_them():
    small, large = CACHE_BYTES // 4, CACHE_BYTES // 4 + 1  # fp32 elements: at and just past the cache
    assert elementwise(3, small, 4) == {"elementwise": ((small * 4, 3 * small),)}
    assert elementwise(3, 0, 4) == {"elementwise": ()}
    assert CPU.elementwise_classes(elementwise(3, small, 4)["elementwise"]) == (3 * small, 0, 0)
    assert CPU.elementwise_classes(elementwise(3, large, 4)["elementwise"]) == (3 * large, 3 * large, 0)
    both = Piece(**elementwise(2, small, 4)) + Piece(**elementwise(5, large, 4))
    assert both.elems == 2 * small + 5 * large and CPU.elementwise_classes(both.elementwise)[1] == 5 * large
    below, huge = MMAP_THRESHOLD_BYTES // 4 - 1, MMAP_THRESHOLD_BYTES // 4  # past glibc's largest heap block
    assert CPU.elementwise_classes(elementwise(1, below, 4)["elementwise"])[2] == 0
    assert CPU.elementwise_classes(elementwise(2, huge, 4)["elementwise"]) == (2 * huge, 2 * huge, 2 * huge)
    assert DEDICATED.elementwise_classes(both.elementwise) == (both.elems, 0, 0)  # accelerators: one class


def test_large_tensors_are_priced_at_the_large_bandwidth():
    n = CACHE_BYTES  # elements; 4 bytes each: a large tensor
    block = [Piece(**elementwise(1, 8, 4))]
    stage = StageCost(first=Piece(**elementwise(2, n, 4)), block=block, blocks=1, last=Piece(), boundary=0, tied_table=0)
    hw = dataclasses.replace(HARDWARE["a100"], host=CPU)
    assert CPU.elementwise_bandwidths(hw) == (hw.elementwise_bandwidth,) * 3  # unset: one bandwidth for every size
    slow = dataclasses.replace(hw, host=dataclasses.replace(CPU, large_elementwise_bandwidth=hw.elementwise_bandwidth / 4))
    extra = compute_seconds(stage, False, slow, 4) - compute_seconds(stage, False, hw, 4)
    expected = 2 * 4 * 2 * n * (4 / hw.elementwise_bandwidth - 1 / hw.elementwise_bandwidth)
    assert extra == pytest.approx(expected, rel=1e-9)
    assert slow.host.elementwise_bandwidths(slow)[2] == hw.elementwise_bandwidth / 4  # unset: as large tensors
    gpu = HARDWARE["a100"]
    assert compute_seconds(stage, False, gpu, 4) == pytest.approx(2 * 4 * (2 * n + 8) / gpu.elementwise_bandwidth)


def test_huge_tensors_are_priced_at_the_huge_bandwidth():
    n = MMAP_THRESHOLD_BYTES // 4  # fp32 elements: a huge tensor, mapped afresh on every use
    stage = StageCost(first=Piece(**elementwise(3, n, 4)), block=[Piece()], blocks=1, last=Piece(), boundary=0,
                      tied_table=0)
    host = dataclasses.replace(CPU, large_elementwise_bandwidth=2e12, huge_elementwise_bandwidth=1e12)
    hw = dataclasses.replace(HARDWARE["a100"], host=host)
    assert compute_seconds(stage, False, hw, 4) == pytest.approx(2 * 4 * 3 * n / 1e12, rel=1e-9)


@pytest.mark.parametrize("share, expected", [(1.0, 5.0), (0.5, 4.0), (0.25, 4.0), (0.9, 4.5)])
def test_the_bubble_of_an_oversubscribed_host_is_lent_to_the_busy_ranks(share, expected):
    """pp=2, 4 micro-batches of 1 s each at the shared speed: (m + pp - 1) = 5 s with a core per
    rank; time-shared, max(m, (m + pp - 1) * max(share, 1 / pp)) s."""
    layout = SimpleNamespace(micro_batches=4, pp=2)
    reports = [SimpleNamespace(micro_seconds=1.0, step_seconds=0.0, share=share, stages_alike=1)] * 2
    assert step_seconds(layout, reports, CPU) == pytest.approx(expected)
    assert step_seconds(layout, reports) == pytest.approx(5.0)  # no host effects: the bubble idles


def test_a_time_shared_pipeline_is_priced_by_its_mean_stage_and_its_critical_path():
    """pp=4 on 4 ranks of 2 cores (share 0.5), 8 micro-batches: stage 0 (1 s), two middle
    stages (1 s each, one report standing for both) and a heavy last stage (5 s). The work is
    m * mean = 8 * 8 / 4 = 16 s; the critical path runs each stage on a whole core (half its
    shared time): 7 * 2.5 + (0.5 + 2 * 0.5 + 2.5) = 21.5 s, the larger. With 16 ranks the stage
    can use at most the 2 cores (share 1/8, each stage at a quarter of its shared time)."""
    def reports(share):
        return [SimpleNamespace(micro_seconds=t, step_seconds=0.0, share=share, stages_alike=n)
                for t, n in ((1.0, 1), (1.0, 2), (5.0, 1))]

    assert step_seconds(SimpleNamespace(micro_batches=8, pp=4), reports(0.5), CPU) == pytest.approx(21.5)
    assert step_seconds(SimpleNamespace(micro_batches=8, pp=4), reports(0.125), CPU) == pytest.approx(
        max(16.0, 7 * 1.25 + 0.25 + 0.5 + 1.25))
    # a core per rank: the heavy stage's 8 micro-batches, one through each other stage
    assert step_seconds(SimpleNamespace(micro_batches=8, pp=4), reports(1.0), CPU) == pytest.approx(7 * 5 + 1 + 2 + 5)
    assert stage_kind_counts(4, 4) == {0: 1, 1: 2, 3: 1}
    assert stage_kind_counts(7, 4) == {0: 1, 1: 2, 3: 1}  # 2, 2, 2, 1 blocks
    assert stage_kind_counts(6, 4) == {0: 1, 1: 1, 2: 1, 3: 1}  # 2, 2, 1, 1 blocks
    assert stage_kind_counts(5, 1) == {0: 1}


def test_a_message_on_an_oversubscribed_host_costs_the_measured_shared_latency():
    """Latency per message through the calibrated points (1, link), (2, 2x), (4, 4x) ranks per
    core, along the last slope beyond; unmeasured hosts scale the link latency by ranks / cores."""
    host = dataclasses.replace(CPU, shared_latency_2x=1e-3, shared_latency_4x=3e-3)
    link, chunk = 1e-4, lambda: None

    def latency(ranks, model=host):
        return model.message_latency(link, ranks, chunk)

    assert latency(1) == link and latency(2) == link  # a core each
    assert latency(3) == pytest.approx(link + 0.5 * (1e-3 - link))
    assert latency(4) == pytest.approx(1e-3)
    assert latency(6) == pytest.approx(2e-3)
    assert latency(8) == pytest.approx(3e-3)
    assert latency(16) == pytest.approx(7e-3)
    assert latency(8, CPU) == pytest.approx(4 * link)  # unmeasured
    assert latency(8, DEDICATED) == link  # accelerators: one device per rank


def test_the_wait_for_a_core_grows_with_the_compute_between_messages():
    """Between the figures calibrated after a short and a long matmul the latency is linear in
    the chunk, held at the nearer figure outside; without the long figures the short ones serve
    (and the chunk is not asked for)."""
    host = dataclasses.replace(CPU, shared_latency_2x=1e-3, shared_latency_4x=3e-3, shared_chunk=2e-3,
                               shared_latency_2x_long=5e-3, shared_latency_4x_long=7e-3, shared_chunk_long=20e-3)
    link = 1e-4
    assert host.message_latency(link, 4, lambda: 0.0) == pytest.approx(1e-3)
    assert host.message_latency(link, 4, lambda: 11e-3) == pytest.approx(3e-3)  # halfway
    assert host.message_latency(link, 4, lambda: 1.0) == pytest.approx(5e-3)
    assert host.message_latency(link, 8, lambda: 20e-3) == pytest.approx(7e-3)
    assert host.message_latency(link, 2, lambda: 1.0) == link  # a core each: no wait
    short_only = dataclasses.replace(host, shared_latency_2x_long=0.0, shared_latency_4x_long=0.0)
    assert short_only.message_latency(link, 4, lambda: pytest.fail("chunk asked for")) == pytest.approx(1e-3)


@pytest.mark.parametrize("p, gloo, nccl", [(2, 1, 1), (3, 2, 2), (4, 2, 3), (8, 3, 7), (9, 4, 8)])
def test_a_broadcast_waits_for_the_messages_of_its_backend(p, gloo, nccl):
    """Gloo broadcasts down a binomial tree (ceil(log2 p) rounds), NCCL down a pipelined ring
    (p - 1 hops); the other collectives are rings on both, and the bytes are the ring's on both."""
    broadcast = Traffic().add(calls("fwd", ("tp",), "broadcast", 1024, p))
    [(_, gloo_bytes, gloo_messages)] = broadcast.links("gloo")
    [(_, nccl_bytes, nccl_messages)] = broadcast.links("nccl")
    assert (gloo_messages, nccl_messages) == (gloo, nccl) and gloo_bytes == nccl_bytes == 1024 * (p - 1) / p
    all_reduce = Traffic().add(calls("fwd", ("tp",), "all_reduce", 1024, p))
    assert all_reduce.messages("gloo") == all_reduce.messages("nccl") == 2 * (p - 1)


def test_the_backend_of_the_hardware_prices_its_broadcasts():
    """The same broadcasts cost (p - 1) latencies on an NCCL preset, ceil(log2 p) on gloo."""
    a100 = HARDWARE["a100"]
    strides = {"dp": (1, 8)}
    broadcasts = Traffic().add(calls("step", ("dp",), "broadcast", 4, 8, times=100))
    nccl = Links(strides, a100).seconds(broadcasts)
    gloo = Links(strides, dataclasses.replace(a100, backend="gloo")).seconds(broadcasts)
    per_byte = 100 * 4 * 7 / 8 / a100.intra_bandwidth
    assert nccl == pytest.approx(per_byte + 100 * 7 * a100.intra_latency)
    assert gloo == pytest.approx(per_byte + 100 * 3 * a100.intra_latency)


def test_each_module_call_costs_its_fixed_host_time_on_a_cpu_only():
    """A walked stage counts one call per module its forward runs (hooks on the real model count
    them here); the CPU host adds ``module_call_seconds`` per call, with checkpointing the
    blocks' forward half again; an accelerator adds nothing."""
    import torch

    from shardzoo.planner.block_costs import costs_of
    from shardzoo.models.gpt2 import GPT2_SPEC
    from shardzoo.planner.model import Batch, assemble
    from shardzoo.planner.walked import family_shape

    config = GPT2_SPEC.config(**GPT2_SPEC.tiny_config(layers=2, vocab=32, ffn=64, hidden=16, heads=2))
    shape = family_shape(GPT2_SPEC, config, "tiny")
    cost = assemble(shape, shape.parts(costs_of("1d", 1, 1, 4), Batch(1, 8, 1, "ring", 4)))
    ran = []
    leaves = [m for m in shape.walk.model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_pre_hook(lambda *_: ran.append(1)) for m in leaves]
    try:
        with torch.no_grad():
            shape.walk.model(torch.zeros(1, 8, dtype=torch.long, device=next(shape.walk.model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    assert cost.modules == len(ran) and cost.block_modules * 2 < len(ran)
    hw = dataclasses.replace(HARDWARE["a100"], host=CPU)
    timed = dataclasses.replace(hw, host=dataclasses.replace(CPU, module_call_seconds=1e-4))
    for ckpt, calls_run in ((False, cost.modules), (True, cost.modules + cost.blocks * cost.block_modules / 2)):
        extra = compute_seconds(cost, ckpt, timed, 4) - compute_seconds(cost, ckpt, hw, 4)
        assert extra == pytest.approx(calls_run * 1e-4, rel=1e-9)
    assert DEDICATED.module_seconds(cost.modules) == 0.0
