"""Pricing one layout: per pipeline stage, the bytes sent, the bytes held and the time of a
training step, for every activation-checkpointing and ZeRO choice.

A training step here is what shardzoo's training loop runs: forward and backward of every
micro-batch (``schedule.step`` when pp > 1), the gradient reduction over dp x sp (DDP for ZeRO
stage 0, FSDP2 otherwise), the tied-embedding sync between pipeline ends, then AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from shardzoo.planner import time as timing
from shardzoo.planner.block_costs import Call, Piece, layout_costs
from shardzoo.planner.comm import DP_AXES, Traffic, dp_reduction, pipeline_p2p, tied_sync
from shardzoo.planner.hardware import Hardware
from shardzoo.planner.memory import MemoryBreakdown, stage_memory
from shardzoo.planner.model import Batch, ModelShape, StageCost, stage_cost


@dataclass(frozen=True)
class Layout:
    """ParallelMesh kwargs plus the micro-batch count."""

    dp: int
    pp: int
    sp: int
    tp: int
    tp_mode: str
    tp_depth: int
    micro_batches: int = 1

    def mesh_kwargs(self) -> dict:
        return dict(dp=self.dp, pp=self.pp, sp=self.sp, tp=self.tp, tp_mode=self.tp_mode, tp_depth=self.tp_depth)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.sp * self.tp

    def __str__(self) -> str:
        depth = f",tp_depth={self.tp_depth}" if self.tp_mode == "2.5d" else ""
        return f"dp={self.dp},pp={self.pp},sp={self.sp},tp={self.tp},tp_mode={self.tp_mode}{depth}"


@dataclass
class StageReport:
    """One pipeline stage of one candidate: traffic of a whole step, memory, seconds."""

    stage: int
    traffic: Traffic
    memory: MemoryBreakdown
    param_bytes: int
    micro_seconds: float  # one micro-batch forward + backward
    step_seconds: float  # per-step communication and the optimizer


def recompute_calls(block: list[Piece]) -> list[Call]:
    """Forward calls activation checkpointing runs again in backward: up to the block's last
    saved tensor (torch's non-reentrant checkpoint stops recomputing there)."""
    last = max((i for i, p in enumerate(block) if p.saved), default=-1)
    out = [c for p in block[:last] for c in p.calls if c.phase == "fwd"]
    return out + ([c for c in block[last].calls if c.phase == "fwd" and not c.after_save] if last >= 0 else [])


def micro_batch_calls(cost: StageCost, layout: Layout, stage: int, checkpointing: bool, zero: int, dp_ranks: int,
                      param_bytes: int) -> tuple[list[tuple[Call, int]], list[Call]]:
    """((call, repeats) of one micro-batch, calls made once per step) of one rank of ``stage``."""
    pp, first, last = layout.pp, stage == 0, stage == layout.pp - 1
    per_mb = [(c, 1) for c in cost.first.calls + cost.last.calls]
    per_mb += [(c, cost.blocks) for p in cost.block for c in p.calls]
    if checkpointing and cost.blocks:
        per_mb += [(Call("bwd", c.axes, c.kind, c.payload, c.group_size, c.times, c.after_save, c.counted), cost.blocks)
                   for c in recompute_calls(cost.block)]
    per_mb += [(c, 1) for c in pipeline_p2p(cost.boundary, pp, first, last)]
    p = cost.params * param_bytes
    units = [b * param_bytes for b in cost.block_params] + [(cost.first.params + cost.last.params) * param_bytes]
    step = []
    for c in dp_reduction(p, p, dp_ranks, zero, units):
        (step.append(c) if c.phase == "step" else per_mb.append((c, 1)))
    if cost.tied_table and pp > 1:
        step += tied_sync(cost.tied_table * param_bytes)
    return per_mb, step


def stage_flops(shape: ModelShape, cost: StageCost, batch: int, seq: int, sp: int, tp: int,
                checkpointing: bool) -> float:
    """FLOPs of one rank of the stage for one micro-batch, forward + backward (+ recompute)."""
    tokens = batch * seq // sp if shape.family != "vit" else batch * -(-shape.config.num_tokens // sp)
    keys = seq if shape.family != "vit" else shape.config.num_tokens
    fwd = cost.blocks * timing.block_flops(shape, tokens, keys)
    ends = timing.end_flops(shape, tokens, batch // sp, cost.is_first, cost.is_last)
    return (fwd * (3 + (1 if checkpointing else 0)) + 3 * ends) / tp


def price_stage(shape: ModelShape, hw: Hardware, layout: Layout, cost: StageCost, batch: Batch, stage: int,
                checkpointing: bool, zero: int, param_bytes: int, schedule: str) -> StageReport:
    """Everything about one rank of ``stage`` for one (checkpointing, zero) choice."""
    dp_ranks = layout.dp * layout.sp
    per_mb, step = micro_batch_calls(cost, layout, stage, checkpointing, zero, dp_ranks, param_bytes)
    one = Traffic()
    for c, k in per_mb:
        one.add([c], k)
    total = one.scaled(layout.micro_batches).add(step)
    memory = stage_memory(cost, stage=stage, pp=layout.pp, micro_batches=layout.micro_batches,
                          checkpointing=checkpointing, zero=zero, dp_ranks=dp_ranks, param_bytes=param_bytes,
                          schedule=schedule, runtime=hw.runtime_bytes)
    strides = timing.axis_strides(**layout.mesh_kwargs())
    share = hw.rank_share(min(layout.world, hw.devices_per_node))
    flops = stage_flops(shape, cost, batch.rows, batch.seq, layout.sp, layout.tp, checkpointing)
    saved = cost.first.saved + cost.last.saved + cost.blocks * sum(p.saved for p in cost.block)
    micro = (flops / (hw.flops * hw.flops_efficiency) + timing.comm_seconds(one, strides, hw)
             + timing.MEMORY_PASSES * saved / hw.mem_bandwidth) / share
    optimizer = timing.ADAM_BYTES_PER_PARAM_BYTE * cost.params * param_bytes / (dp_ranks if zero else 1)
    step_s = (timing.comm_seconds(Traffic().add(step), strides, hw) + optimizer / hw.mem_bandwidth) / share
    held = cost.params * param_bytes
    return StageReport(stage, total, memory, held // dp_ranks if zero == 3 else held, micro, step_s)


def stage_costs(shape: ModelShape, layout: Layout, batch: Batch, param_bytes: int) -> list[StageCost]:
    """The StageCost of every pipeline stage (raises block_costs.Illegal for a layout that
    cannot be built)."""
    costs = layout_costs(layout.tp_mode, layout.tp, layout.tp_depth, param_bytes)
    return [stage_cost(shape, costs, batch, k, layout.pp) for k in range(layout.pp)]


def step_seconds(layout: Layout, reports: list[StageReport]) -> float:
    slowest = max(r.micro_seconds for r in reports)
    return (layout.micro_batches + layout.pp - 1) * slowest + max(r.step_seconds for r in reports)


def worst_bytes(reports: list[StageReport]) -> Fraction:
    return max(r.traffic.total() for r in reports)


__all__ = ["DP_AXES", "Layout", "StageReport", "price_stage", "stage_costs", "step_seconds", "worst_bytes"]


def channel_bytes(cost: StageCost, layout: Layout, stage: int, checkpointing: bool, zero: int,
                  param_bytes: int) -> dict[str, Fraction]:
    """Bytes one rank of ``stage`` sends in a step, split by who sends them: ``counted`` (through
    shardzoo.comm, so comm.count sees it), ``ddp`` (the dp x sp gradient reduction), ``p2p``
    (pipeline stage sends), ``tied`` (the tied-table sync) and ``other`` (direct calls elsewhere)."""
    from shardzoo.planner.comm import call_bytes

    per_mb, step = micro_batch_calls(cost, layout, stage, checkpointing, zero, layout.dp * layout.sp, param_bytes)
    out = {k: Fraction(0) for k in ("counted", "ddp", "p2p", "tied", "other")}
    for c, k in [(c, k * layout.micro_batches) for c, k in per_mb] + [(c, 1) for c in step]:
        if c.counted:
            key = "counted"
        elif c.axes == DP_AXES:
            key = "ddp"
        elif c.axes == ("pp",):
            key = "p2p" if c.kind == "send" else "tied"
        else:
            key = "other"
        out[key] += call_bytes(c) * k
    return out
