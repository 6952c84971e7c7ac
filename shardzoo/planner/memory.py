"""Bytes one rank holds at its peak during a training step (docs/planner.md, "Memory").

    peak = runtime + params + optimizer + ddp_buckets + zero3_units
           + max(k * A + R + min(G, G_last), G + (k - 1) * A + A_first) + workspace

with k the micro-batches a stage holds activations of at once (1F1B: min(pp - stage, m);
GPipe: m; the other schedules: ``schedules.in_flight``), A the activation bytes of one micro-batch (saved tensors, and the stage's input /
output the pipeline keeps), R the activations one block recomputes under checkpointing, G the
gradient bytes (G_last / A_first: of the head / the embeddings, the first gradients made and
the last activations freed). DDP's buckets (stages 0 and 1) hold another copy of the
gradients. AdamW keeps two moments per parameter; ZeRO stage z shards the optimizer (z >= 1),
the gradients (z >= 2) and the parameters (z = 3) over the dp x sp group, as in the ZeRO paper
(Rajbhandari et al. 2020); for a ``parallelize``'d model, whose backward averages over sp
itself, stages 0 and 1 (DDP, ZeroRedundancyOptimizer) run over dp only.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardzoo.planner.model import StageCost
from shardzoo.planner.schedules import in_flight

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, in the parameter dtype


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes of one rank, by term (``activations``: of the k micro-batches in flight;
    ``dynamic``: the larger of the two backward moments of the formula, gradients included)."""

    runtime: int
    params: int
    grads: int
    optimizer: int
    buffers: int  # DDP's gradient buckets, or FSDP2's gathered units
    activations: int
    dynamic: int
    workspace: int

    @property
    def peak(self) -> int:
        return self.runtime + self.params + self.optimizer + self.buffers + self.dynamic + self.workspace


def activation_bytes(cost: StageCost, checkpointing: bool, first: bool, last: bool) -> tuple[int, int]:
    """(bytes of one micro-batch's activations, of its embeddings alone)."""
    blocks = cost.blocks * (cost.kept_per_block if checkpointing else cost.block_saved)
    kept = (0 if first else cost.boundary) + (0 if last else cost.boundary)  # stage input / output
    return cost.first.saved + blocks + cost.last.saved + kept, cost.first.saved


def stage_memory(cost: StageCost, *, stage: int, pp: int, micro_batches: int, checkpointing: bool, zero: int,
                 dp_ranks: int, param_bytes: int, schedule: str, runtime: int,
                 virtual_stages: int = 1) -> MemoryBreakdown:
    """Peak bytes of one rank of pipeline stage ``stage`` (``dp_ranks``: the group ZeRO shards over and
    DDP reduces over: dp x sp, or dp for stages 0 / 1 of a ``parallelize``'d model)."""
    first, last = cost.is_first, cost.is_last
    n = dp_ranks
    p = cost.params * param_bytes
    g_last = cost.last.params * param_bytes
    params = p // n if zero == 3 else p
    # a pipeline adds its micro-batches' gradients to whole ones and reduce-scatters once, at the end
    grads = p // n if zero >= 2 and pp == 1 else p
    optimizer = ADAM_MOMENTS * p // (n if zero >= 1 else 1)
    if zero <= 1:
        buffers = p if n > 1 else 0  # DDP (stages 0 and 1) copies gradients into its buckets
    elif zero == 3:
        units = [b * param_bytes for b in cost.block_params] + [(cost.first.params + cost.last.params) * param_bytes]
        buffers = 2 * max(units)  # the unit running and the one prefetched
    else:
        buffers = 0
    per_mb, embed = activation_bytes(cost, checkpointing, first, last)
    k = in_flight(schedule, stage, pp, micro_batches, virtual_stages)
    held = int(k * per_mb)
    recompute = cost.block_saved if checkpointing and cost.blocks else 0
    dynamic = max(held + recompute + min(grads, g_last), grads + held - per_mb + embed)
    workspace = cost.workspace + 2 * cost.kept_per_block
    return MemoryBreakdown(runtime, params, grads, optimizer, buffers, held, dynamic, workspace)
