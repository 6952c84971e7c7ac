"""Pricing one candidate: per pipeline stage, the bytes sent, the bytes held and the time of a
training step, for every activation-checkpointing and ZeRO choice.

A training step here is what shardzoo's training loop runs: forward and backward of every
micro-batch (``schedule.step`` when pp > 1), the gradient reduction over dp x sp (DDP for ZeRO
stages 0 and 1, then ZeroRedundancyOptimizer's parameter broadcasts in stage 1; FSDP2 in 2 and
3), the tied-embedding sync between pipeline ends, then AdamW. A ``parallelize``'d model
averages each gradient over sp in every backward (one all-reduce per parameter tensor), and its
DDP and ZeroRedundancyOptimizer (stages 0 and 1) then run over dp only.
:class:`Pricer` keeps what candidates share (the pieces of a tp grid x sp x micro-batch size, and
their summed calls), so a plan over thousands of candidates builds each only once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

from shardzoo.comm.mesh import tp_grid_text
from shardzoo.planner.block_costs import Call, Illegal, Piece, costs_of
from shardzoo.planner import time as timing
from shardzoo.planner.comm import (DDP_AXES, Traffic, dp_reduction, edp_reduction, pipeline_p2p, sp_grad_average,
                                   tied_sync)
from shardzoo.planner.hardware import Hardware
from shardzoo.planner.memory import MemoryBreakdown, sharded, stage_memory
from shardzoo.planner.model import (COUNT_BYTES, LOSS_PAIR_BYTES, Batch, StageCost, assemble, loss_reduction,
                                    target_axes)


@dataclass(frozen=True)
class Candidate:
    """One candidate the planner enumerates: ParallelMesh kwargs plus the micro-batch count."""

    dp: int
    pp: int
    sp: int
    tp: int
    tp_mode: str
    tp_depth: int
    micro_batches: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (schedules.SCHEDULES); 1: one stage each
    ep: int = 1  # ranks of dp x sp the experts of a MoE layer are split over (1: none)
    schedule: str = "1f1b"  # the pipeline schedule (a key of schedules.SCHEDULES), when pp > 1

    def mesh_kwargs(self) -> dict:
        """ParallelMesh's kwargs; ``ep`` only where the experts are split (ep > 1)."""
        out = dict(dp=self.dp, pp=self.pp, sp=self.sp, tp=self.tp, tp_mode=self.tp_mode, tp_depth=self.tp_depth)
        return {**out, "ep": self.ep} if self.ep > 1 else out

    @property
    def edp(self) -> int:
        """Ranks holding the same experts, over which their gradients are averaged: dp x sp / ep."""
        return self.dp * self.sp // self.ep

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.sp * self.tp

    def __str__(self) -> str:
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        return f"dp={self.dp},pp={self.pp},sp={self.sp},{tp_grid_text(self.tp, self.tp_mode, self.tp_depth)}{ep}"


@dataclass
class StageReport:
    """One rank of one pipeline stage of a candidate (``Pricer.traffic`` gives its calls)."""

    stage: int
    memory: MemoryBreakdown
    param_bytes: int
    micro_seconds: float  # one micro-batch forward + backward
    step_seconds: float  # per-step communication and the optimizer
    compute_seconds: float  # of micro_seconds: matmuls and memory-bound work
    comm_scaled: int  # bytes of a whole step times ``denominator``
    denominator: int
    share: float = 1.0  # the host model's rank_share: below 1 when ranks time-share a CPU host's cores
    stages_alike: int = 1  # pipeline stages of this one's kind (same ends and block count), itself included
    forward_seconds: float = 0.0  # of micro_seconds: the forward (F of the zero-bubble schedules)
    weight_seconds: float = 0.0  # of micro_seconds: the weight-gradient matmuls (their W)

    @property
    def comm_bytes(self) -> Fraction:
        """Bytes this rank sends in a whole step (exact)."""
        return Fraction(self.comm_scaled, self.denominator)


def recompute_calls(block: list[Piece]) -> list[Call]:
    """Forward calls activation checkpointing runs again in backward: up to the block's last
    saved tensor (torch's non-reentrant checkpoint stops recomputing there)."""
    last = max((i for i, p in enumerate(block) if p.saves_any), default=-1)
    out = [c for p in block[:last] for c in p.calls if c.phase == "fwd"]
    return out + ([c for c in block[last].calls if c.phase == "fwd" and not c.after_save] if last >= 0 else [])


class Pricer:
    """Prices the candidates of one problem (``enumerate.Problem``) on ``hw``."""

    def __init__(self, problem, hw: Hardware):
        self.problem, self.hw = problem, hw
        walk = getattr(problem.shape, "walk", None)
        self._transformers = bool(getattr(walk, "transformers", False))  # run by transformers' code
        self._parts: dict[tuple, object] = {}
        self._sums: dict[tuple, tuple[object, Traffic]] = {}
        self._reductions: dict[tuple, tuple[Traffic, Traffic]] = {}
        self._totals: dict[int, tuple[Traffic, int]] = {}
        self._computes: dict[tuple, tuple[StageCost, float]] = {}
        self._bases: dict[tuple, tuple[StageCost, Traffic]] = {}
        self.denominator = 2 * problem.world  # every group is a divisor of the world, or the tied pair

    def batch(self, candidate: Candidate) -> Batch:
        p = self.problem
        return Batch(p.global_batch // candidate.dp // candidate.micro_batches, p.seq, candidate.sp, p.sp_mode, p.e,
                     True, p.mask_bytes, p.attention, p.chunks(candidate.tp_mode, candidate.tp, candidate.pp),
                     candidate.ep)

    def stages(self, candidate: Candidate) -> list[StageCost]:
        """Every pipeline stage's StageCost (raises Illegal for a candidate that cannot be built)."""
        parts = self._stage_parts(candidate)
        return [assemble(self.problem.shape, parts, k, candidate.pp) for k in range(candidate.pp)]

    def distinct_stages(self, candidate: Candidate) -> list[tuple[int, StageCost]]:
        """(index, StageCost) of the first stage of each kind (same ends and block count): the
        one of its kind holding the most micro-batches in flight, so the worst."""
        parts, shape, pp = self._stage_parts(candidate), self.problem.shape, candidate.pp
        base, extra = divmod(shape.layers, pp)
        picks = {0, pp - 1, 1 if pp > 2 else 0, extra if 0 < extra < pp - 1 else 0}
        return [(k, assemble(shape, parts, k, pp)) for k in sorted(picks)]

    def _stage_parts(self, candidate: Candidate):
        b = self.batch(candidate)
        key = (candidate.tp_mode, candidate.tp, candidate.tp_depth, candidate.sp, b.rows, b.chunks, b.ep)
        parts = self._parts.get(key)
        if parts is None:
            costs = costs_of(candidate.tp_mode, candidate.tp, candidate.tp_depth, self.problem.param_bytes)
            try:
                parts = self.problem.shape.parts(costs, b)
            except Illegal as err:
                parts = err
            self._parts[key] = parts
        if isinstance(parts, Illegal):
            raise parts
        if candidate.pp > self.problem.shape.layers:
            raise Illegal(f"pp={candidate.pp} exceeds the model's {self.problem.shape.layers} blocks")
        return parts

    def _summed(self, what: str, obj, call_list) -> Traffic:
        """The Traffic of ``call_list``, kept per (what, obj); obj is held so its id stays its own."""
        entry = self._sums.get((what, id(obj)))
        if entry is None or entry[0] is not obj:
            entry = self._sums[(what, id(obj))] = (obj, Traffic().add(call_list))
        return entry[1]

    def traffic(self, cost: StageCost, candidate: Candidate, stage: int, checkpointing: bool,
                zero: int) -> tuple[Traffic, Traffic]:
        """(per micro-batch, per step) calls of one rank of ``stage``, summed."""
        one = Traffic().merge(self._base(cost, candidate, stage))
        if checkpointing and cost.blocks:
            one.merge(self._summed("recompute", cost.block, recompute_calls(cost.block)), cost.blocks, phase="bwd")
        z_one, step = self._reduction(cost, candidate, zero)
        return one.merge(z_one), step

    def _total(self, traffic: Traffic) -> int:
        """traffic.total() times ``self.denominator`` (an integer: every group size divides it),
        kept for the Traffic objects the caches hold, so candidates add integers."""
        entry = self._totals.get(id(traffic))
        if entry is None or entry[0] is not traffic:
            entry = self._totals[id(traffic)] = (traffic, traffic.scaled_total(self.denominator))
        return entry[1]

    def _base(self, cost: StageCost, candidate: Candidate, stage: int) -> Traffic:
        """The stage's own calls per micro-batch (its pieces, the loss, the pipeline sends), kept
        per StageCost object and what else they depend on (the schedules of a layout share it);
        callers merge it, never change it."""
        key = (id(cost), stage, candidate.pp, candidate.virtual_stages, candidate.dp, candidate.sp)
        entry = self._bases.get(key)
        if entry is None or entry[0] is not cost:
            entry = self._bases[key] = (cost, self._base_calls(cost, candidate, stage))
        return entry[1]

    def _base_calls(self, cost: StageCost, candidate: Candidate, stage: int) -> Traffic:
        one = Traffic()
        one.merge(self._summed("piece", cost.first, cost.first.calls))
        one.merge(self._summed("piece", cost.last, cost.last.calls))
        one.merge(self._summed("block", cost.block, [c for p in cost.block for c in p.calls]), cost.blocks)
        if stage == candidate.pp - 1:
            one.add(loss_reduction(self._target_axes(candidate), LOSS_PAIR_BYTES, candidate.pp))
        return one.add(pipeline_p2p(cost.boundary, candidate.pp, stage == 0, stage == candidate.pp - 1,
                                    candidate.virtual_stages))

    def _target_axes(self, candidate: Candidate) -> list[tuple[str, int]]:
        costs = costs_of(candidate.tp_mode, candidate.tp, candidate.tp_depth, self.problem.param_bytes)
        return target_axes(self.problem.shape, costs, candidate.dp, candidate.sp)

    def sp_in_backward(self, candidate: Candidate, zero: int) -> bool:
        """Whether backward itself averages the gradients over sp (a ``parallelize``'d model
        with sp > 1, its parameters not FSDP2's: ZeRO 0 / 1)."""
        return self.problem.shape.averages_sp_in_backward and candidate.sp > 1 and zero <= 1

    def dp_ranks(self, candidate: Candidate, zero: int) -> int:
        """Ranks ``data_parallel`` averages over and ZeRO shards over: dp x sp, or dp where
        backward averages over sp already (``sp_in_backward``)."""
        return candidate.dp if self.sp_in_backward(candidate, zero) else candidate.dp * candidate.sp

    def _reduction(self, cost: StageCost, candidate: Candidate, zero: int) -> tuple[Traffic, Traffic]:
        """(per micro-batch, per step) calls of the gradient reduction and the tied sync."""
        n, tied = candidate.dp * candidate.sp, cost.tied_table and candidate.pp > 1
        key = (cost.params, cost.tensors, cost.first.params + cost.last.params, cost.blocks, n, zero, tied, cost.is_last,
               candidate.pp, candidate.dp, candidate.sp, candidate.tp_mode, candidate.tp, candidate.tp_depth,
               candidate.ep, cost.edp_params)
        if key not in self._reductions:
            self._reductions[key] = self._reduction_calls(cost, candidate, zero)
        return self._reductions[key]

    def _reduction_calls(self, cost: StageCost, candidate: Candidate, zero: int) -> tuple[Traffic, Traffic]:
        ep, one, step = self.problem.param_bytes, Traffic(), Traffic()
        # the experts split over ep are averaged over edp (their own layer, or FSDP2 there), the rest over dp x sp
        p, tensors = (cost.params - cost.edp_params) * ep, cost.tensors - cost.edp_tensors
        units = [(b - cost.block_edp_params) * ep for b in cost.block_params]
        units.append((cost.first.params + cost.last.params) * ep)
        hooked = self.sp_in_backward(candidate, zero)
        if hooked:  # every backward (micro-batch) averages each parameter's gradient over sp
            one.add(sp_grad_average(p, candidate.sp, tensors))
        axes = DDP_AXES[1] if hooked else DDP_AXES[0]
        experts = edp_reduction([cost.block_edp_params * ep] * cost.blocks, candidate.edp, zero, cost.edp_tensors,
                                 candidate.pp > 1)
        for c in dp_reduction(p, p, self.dp_ranks(candidate, zero), zero, units, tensors, axes) + experts:
            (step if c.phase == "step" else one).add([c])
        if cost.tied_table and candidate.pp > 1:
            step.add(tied_sync(cost.tied_table * ep))
        if candidate.pp > 1 and self.problem.shape.builder is None:  # shardzoo.pipeline: every rank counts over dp
            step.add(loss_reduction([("dp", candidate.dp)], COUNT_BYTES, candidate.pp, phase="step"))
        elif candidate.pp > 1 and cost.is_last:  # build_schedule counts the step's targets once
            step.add(loss_reduction(self._target_axes(candidate), COUNT_BYTES, candidate.pp, phase="step"))
        return one, step

    def links(self, candidate: Candidate, costs=None) -> tuple[timing.Links, timing.Links]:
        """(per micro-batch, per step) prices of ``candidate``'s groups. Where the host model's
        message latency depends on the compute between messages (a time-shared host, where a
        message waits for a core while a core-mate computes) it gets ``longest_chunk``; the
        per-step calls (gradient reduction, parameter broadcasts) follow one another with no
        compute in between, so they get none."""
        hw = self.hw
        strides, ranks = timing.axis_strides(**candidate.mesh_kwargs()), min(candidate.world, hw.devices_per_node)
        # the same for every group: worked out once, and only if the host model asks for it
        chunk = functools.cache(lambda: self.longest_chunk(costs if costs is not None
                                                           else self.distinct_stages(candidate)))
        return timing.Links(strides, hw, ranks, chunk), timing.Links(strides, hw, ranks, lambda: 0.0)

    def price_variants(self, candidate: Candidate, cost: StageCost, stage: int, checkpointing, zeros,
                       links=None) -> dict:
        """{(checkpointing, zero): StageReport} of one rank of ``stage``; what the variants share
        (the blocks' calls, their seconds) is summed once. ``links``: ``self.links(candidate)``."""
        hw, problem, ep = self.hw, self.problem, self.problem.param_bytes
        m = candidate.micro_batches
        base = self._base(cost, candidate, stage)
        links, step_links = links or self.links(candidate)
        share = links.share
        base_bytes, base_s = self._total(base), links.seconds(base)
        rc = self._summed("recompute", cost.block, recompute_calls(cost.block))
        rc_bytes, rc_s = self._total(rc) * cost.blocks, links.seconds(rc) * cost.blocks
        experts, edp = cost.edp_params * ep, candidate.edp
        dense = cost.params * ep - experts
        out = {}
        for zero in zeros:
            n = self.dp_ranks(candidate, zero)
            z_one, step = self._reduction(cost, candidate, zero)
            z_bytes, z_s = self._total(z_one), links.seconds(z_one)
            optimizer = timing.optimizer_seconds(sharded(dense, experts, n, edp, zero > 0) / ep, hw)
            step_s = step_links.seconds(step) + optimizer / share
            ddp_s, ddp_calls = self._ddp_seconds(step, step_links) if zero <= 1 else (0.0, 0)
            step_bytes = self._total(step)
            # the weight-gradient matmuls: as many FLOPs as the forward's
            weights = cost.work[0] / (hw.flops * hw.flops_efficiency) / share
            for ckpt in checkpointing:
                memory = stage_memory(cost, stage=stage, pp=candidate.pp, micro_batches=m, checkpointing=ckpt,
                                      zero=zero, dp_ranks=n, param_bytes=ep, schedule=candidate.schedule,
                                      runtime=hw.runtime_for(self._transformers),
                                      virtual_stages=candidate.virtual_stages, edp_ranks=edp)
                compute = self._compute_seconds(cost, ckpt) / share
                # backward (with the recompute in it) is (2 + r) / (3 + r) of a micro-batch's compute
                r = 1 if ckpt and cost.blocks else 0
                hidden = ddp_s - hw.host.exposed_reduction(ddp_s, ddp_calls, compute * (2 + r) / (3 + r))
                comm_s = base_s + z_s + (rc_s if ckpt and cost.blocks else 0.0)
                per_mb = base_bytes + z_bytes + (rc_bytes if ckpt and cost.blocks else 0)
                micro = compute + comm_s
                out[(ckpt, zero)] = StageReport(stage, memory, sharded(dense, experts, n, edp, zero == 3), micro,
                                                step_s - hidden, compute, per_mb * m + step_bytes, self.denominator,
                                                share, forward_seconds=micro / (3 + r), weight_seconds=weights)
        return out

    def _compute_seconds(self, cost: StageCost, checkpointing: bool) -> float:
        """timing.compute_seconds of ``cost``, kept per StageCost object (the schedules and ZeRO
        stages of one layout share it)."""
        key = (id(cost), checkpointing)
        entry = self._computes.get(key)
        if entry is None or entry[0] is not cost:
            entry = self._computes[key] = (cost, timing.compute_seconds(cost, checkpointing, self.hw, self.problem.e))
        return entry[1]

    @staticmethod
    def _ddp_seconds(step: Traffic, links: timing.Links) -> tuple[float, int]:
        """(seconds, calls) of the step's DDP gradient all-reduce (ZeRO 0 / 1), which may hide
        under backward (``host.exposed_reduction``)."""
        ddp = Traffic()
        ddp.sums = {k: v for k, v in step.sums.items() if k[1] in DDP_AXES and k[2] == "all_reduce"}
        return links.seconds(ddp), sum(n for _, n in ddp.sums.values())

    def longest_chunk(self, costs) -> float:
        """The longest compute (seconds on a whole device) any piece of any stage runs between
        two of its messages: its work over its messages plus one. A message between
        time-shared ranks waits for the core its receiver shares, and the rank on that core may
        be in such a stretch (the LM head and loss, a block's MLP) whatever the receiver itself
        runs."""
        hw, e = self.hw, self.problem.e
        return max(timing.piece_seconds(piece, hw, e)
                   / (1 + self._summed("piece", piece, piece.calls).messages(hw.backend))
                   for _, cost in costs for piece in (cost.first, cost.last, *cost.block))

    def price(self, candidate: Candidate, checkpointing=(False, True), zeros=(0,),
              costs: list[StageCost] | None = None) -> dict:
        """{(checkpointing, zero): [StageReport]} over the stages that can be the worst: the
        first of each kind (same ends and block count), which holds the most micro-batches."""
        costs = costs if costs is not None else self.distinct_stages(candidate)
        alike = stage_kind_counts(self.problem.shape.layers, candidate.pp)
        links = self.links(candidate, costs)
        out = {}
        for k, cost in costs:
            for key, report in self.price_variants(candidate, cost, k, checkpointing, zeros, links).items():
                report.stages_alike = alike.get(k, 1)
                out.setdefault(key, []).append(report)
        return out


def stage_kind_counts(layers: int, pp: int) -> dict[int, int]:
    """{first stage of each kind: how many of the ``pp`` stages are of that kind}; a kind is
    (holds the embeddings, holds the head, block count), blocks split as ``models.stage_blocks``
    splits them (the first ``layers % pp`` stages get one more)."""
    base, extra = divmod(layers, pp)
    first: dict[tuple, int] = {}
    counts: dict[int, int] = {}
    for k in range(pp):
        rep = first.setdefault((k == 0, k == pp - 1, base + (k < extra)), k)
        counts[rep] = counts.get(rep, 0) + 1
    return counts


def _channel(key) -> str:
    """Who sends an entry: shardzoo.comm (counted), DDP / FSDP2, torch pipelining, the tied sync."""
    phase, axes, kind, _, counted = key
    if counted:
        return "counted"
    if axes in DDP_AXES:
        return "ddp"
    if axes == ("pp",):
        return "p2p" if kind == "send" else "tied"
    return "other"


def channel_bytes(per_micro_batch: Traffic, per_step: Traffic, micro_batches: int) -> dict[str, Fraction]:
    """A step's bytes of one stage split by sender: ``counted`` (through shardzoo.comm, which
    comm.count sees), ``ddp`` (the dp x sp, or dp, gradient reduction of DDP / FSDP2), ``p2p`` (pipeline stage sends),
    ``tied`` (the tied-table sync), ``other`` (direct torch.distributed calls elsewhere)."""
    out = {k: Fraction(0) for k in ("counted", "ddp", "p2p", "tied", "other")}
    for k, v in per_micro_batch.bytes_by(_channel).items():
        out[k] += v * micro_batches
    for k, v in per_step.bytes_by(_channel).items():
        out[k] += v
    return out
