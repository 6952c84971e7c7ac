"""Step time of a candidate (docs/planner.md, "Time").

    t_stage   = (3 * matmul FLOPs / (F * efficiency) + 3 * attention FLOPs / F_attention
                 + elementwise passes * 2 * e / elementwise bandwidth (per tensor class)
                 + sum over groups bytes / bandwidth) / share + sum over groups messages * latency
    t_step    = (m - 1) * max over stages of t_stage + sum over stages of t_stage
                (GPipe and 1F1B: the slowest stage's m micro-batches, one through each other
                stage to fill and drain)
                + per-step communication (gradient reduction, tied table) + optimizer step

What the host adds is its host model's (``Hardware.host``, planner/host.py): a rank's share of
its device, the latency of a message, the pipeline part of a step, and the tensor classes of
elementwise work with their bandwidths. With no host effects the share is 1, a message costs
its link's latency and every tensor is of one class.

Placement: ranks are numbered dp, pp, sp, tp (tp fastest; the tp sub-axes slow to fast as in
ParallelMesh), so the tp and sp groups are the ones that stay inside a node. A group is inside a
node when ``devices_per_node`` is a multiple of its slowest axis' stride times that axis' size;
otherwise it is costed at the inter-node bandwidth and latency.
"""

from __future__ import annotations

from shardzoo.comm.tp_grids import tp_grid
from shardzoo.planner.experts import expert_axis_strides
from shardzoo.planner.hardware import Hardware
from shardzoo.planner.host import DEDICATED

ADAM_PASSES = 12  # elementwise passes of torch's single-tensor AdamW per parameter


def axis_strides(dp: int, pp: int, sp: int, tp: int, tp_mode: str, tp_depth: int,
                 ep: int = 1) -> dict[str, tuple[int, int]]:
    """axis -> (stride in the global rank order, size); the expert axes "ep" and "edp" as the
    slowest axis they span (experts.expert_axis_strides)."""
    grid = tp_grid(tp_mode)
    names = ("dp", "pp", "sp") + grid.sub_axes
    sizes = (dp, pp, sp) + grid.shape(tp, tp_depth)
    out, stride = {}, 1
    for name, size in reversed(list(zip(names, sizes))):
        out[name] = (stride, size)
        stride *= size
    return {**out, **expert_axis_strides(dp, pp, sp, tp, ep)}


def link(axes: tuple[str, ...], strides: dict[str, tuple[int, int]], hw: Hardware) -> tuple[float, float]:
    """(bandwidth, latency) of the group spanning ``axes``."""
    slowest = max((strides[a] for a in axes), key=lambda s: s[0])
    inside = hw.devices_per_node % (slowest[0] * slowest[1]) == 0
    return (hw.intra_bandwidth, hw.intra_latency) if inside else (hw.inter_bandwidth, hw.inter_latency)


class Links:
    """Seconds of the calls of one candidate, per group: bytes at the group's link bandwidth
    (divided by ``share``, the rank's share of its device: on a time-shared host copies run at
    the rank's share of a core) plus messages at the link's latency as the host model puts it
    for ``ranks_on_node`` ranks. ``chunk``: a function giving the longest compute (seconds on a
    whole device) a rank runs between two messages, called only by host models whose message
    latency depends on it (``evaluate.Pricer.longest_chunk``)."""

    def __init__(self, strides: dict[str, tuple[int, int]], hw: Hardware, ranks_on_node: int = 1,
                 chunk=lambda: None):
        self.strides, self.hw, self._cache = strides, hw, {}
        self.share, self.ranks, self.chunk = hw.host.rank_share(ranks_on_node), ranks_on_node, chunk

    def per_group(self, axes: tuple[str, ...]) -> tuple[float, float]:
        """(seconds per byte, seconds per message) of the group spanning ``axes``."""
        lk = self._cache.get(axes)
        if lk is None:
            bandwidth, latency = link(axes, self.strides, self.hw)
            per_message = self.hw.host.message_latency(latency, self.ranks, self.chunk)
            lk = self._cache[axes] = (1 / (bandwidth * self.share), per_message)
        return lk

    def seconds(self, traffic) -> float:
        """Seconds to send ``traffic`` (a comm.Traffic) at each group's link."""
        total = 0.0
        for axes, n, messages in traffic.links(self.hw.backend):
            per_byte, per_message = self.per_group(axes)
            total += n * per_byte + messages * per_message
        return total


def step_seconds(candidate, reports, host=DEDICATED, schedule: str = "1f1b") -> float:
    """Seconds of a training step of ``candidate`` (an ``evaluate.Candidate``) from its priced stages
    (``evaluate.StageReport``s): the m micro-batches through the pipeline (the host model's
    ``pipeline_seconds``: ``(m - 1) * max_k t_k + sum_k t_k``, the familiar ``(m + pp - 1) * t``
    when the stages are alike; ``schedule``, one of ``schedules.SCHEDULES``, where v > 1), then
    the per-step work."""
    m, pp, v = candidate.micro_batches, candidate.pp, getattr(candidate, "virtual_stages", 1)
    schedule = getattr(candidate, "schedule", schedule)
    if pp == 1:
        pipe = m * max(r.micro_seconds for r in reports)
    else:  # a host model without interleaving (v = 1) is asked as before
        pipe = host.pipeline_seconds(m, pp, reports, v, schedule) if v > 1 else host.pipeline_seconds(m, pp, reports)
    return pipe + max(r.step_seconds for r in reports)


def compute_seconds(cost, checkpointing: bool, hw: Hardware, e: int) -> float:
    """Seconds of one rank's work for one micro-batch of a stage (a model.StageCost): matmuls
    (backward twice the forward) at the achievable FLOP/s, attention at the kernel's FLOP/s,
    elementwise passes at the elementwise bandwidths; checkpointing runs the blocks' forward again."""
    flops, attn, work = cost.work
    again = cost.blocks if checkpointing else 0
    b_flops, b_attn, b_work = cost.block_work
    matmul = (3 * flops + again * b_flops) / (hw.flops * hw.flops_efficiency)
    attention = (3 * attn + again * b_attn) / hw.attention_flops
    classes, b_classes = hw.host.elementwise_classes(work), hw.host.elementwise_classes(b_work)
    # the recompute runs the forward half of the passes (and of the module calls) again
    elems, big, huge = (x + again * b / 2 for x, b in zip(classes, b_classes))
    calls = hw.host.module_seconds(cost.modules + again * cost.block_modules / 2)
    return matmul + attention + elementwise_seconds(elems, big, huge, hw, e) + calls


def elementwise_seconds(elems: float, big: float, huge: float, hw: Hardware, e: int) -> float:
    """Seconds of ``elems`` elementwise passes (of which ``big`` over large tensors and of those
    ``huge`` over huge ones, as the host model classes them), each reading and writing ``e``
    bytes per element."""
    small, large = elems - big, big - huge
    bandwidth, large_bandwidth, huge_bandwidth = hw.host.elementwise_bandwidths(hw)
    return 2 * e * (small / bandwidth + large / large_bandwidth + huge / huge_bandwidth)


def piece_seconds(piece, hw: Hardware, e: int) -> float:
    """Seconds of one piece's forward and backward on a whole device (as ``compute_seconds``)."""
    matmul = 3 * piece.flops / (hw.flops * hw.flops_efficiency) + 3 * piece.attn_flops / hw.attention_flops
    return (matmul + elementwise_seconds(*hw.host.elementwise_classes(piece.elementwise), hw, e)
            + hw.host.module_seconds(piece.modules))


def optimizer_seconds(param_elements: float, hw: Hardware) -> float:
    """AdamW over this rank's parameters (fp32): about a dozen elementwise passes."""
    return ADAM_PASSES * param_elements * 8 / hw.elementwise_bandwidth
