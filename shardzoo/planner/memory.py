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
itself, stages 0 and 1 (DDP, ZeroRedundancyOptimizer) run over dp only. Experts split over ep
are sharded over the expert data parallel group edp instead (dp x sp / ep ranks), each MoE
layer's experts an FSDP2 unit of their own, and stay out of DDP's buckets.
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


def sharded(dense: int, experts: int, n: int, edp: int, on: bool) -> int:
    """Bytes held of ``dense`` bytes sharded over ``n`` ranks and ``experts`` bytes over ``edp``
    ranks where ``on``, else of both whole."""
    return dense // n + experts // edp if on else dense + experts


def stage_memory(cost: StageCost, *, stage: int, pp: int, micro_batches: int, checkpointing: bool, zero: int,
                 dp_ranks: int, param_bytes: int, schedule: str, runtime: int,
                 virtual_stages: int = 1, edp_ranks: int = 1) -> MemoryBreakdown:
    """Peak bytes of one rank of pipeline stage ``stage`` (``dp_ranks``: the group ZeRO shards over and
    DDP reduces over: dp x sp, or dp for stages 0 / 1 of a ``parallelize``'d model; ``edp_ranks``:
    the group the experts split over ep are averaged and sharded over, dp x sp / ep)."""
    first, last = cost.is_first, cost.is_last
    n = dp_ranks
    p = cost.params * param_bytes
    experts = cost.edp_params * param_bytes  # of p: kept out of DDP, sharded over edp (their own FSDP2 units)
    dense = p - experts
    g_last = cost.last.params * param_bytes
    params = sharded(dense, experts, n, edp_ranks, zero == 3)
    # a pipeline adds its micro-batches' gradients to whole ones and reduce-scatters once, at the end
    grads = sharded(dense, experts, n, edp_ranks, zero >= 2 and pp == 1)
    optimizer = sharded(ADAM_MOMENTS * dense, ADAM_MOMENTS * experts, n, edp_ranks, zero >= 1)
    if zero <= 1:
        buffers = dense if n > 1 else 0  # DDP (stages 0 and 1) copies gradients into its buckets
    elif zero == 3:
        block = cost.block_edp_params * param_bytes
        units = [b * param_bytes - block for b in cost.block_params]
        units.append((cost.first.params + cost.last.params) * param_bytes)
        buffers = 2 * max(units + ([block] if block else []))  # the unit running and the one prefetched
    else:
        buffers = 0
    per_mb, embed = activation_bytes(cost, checkpointing, first, last)
    k = in_flight(schedule, stage, pp, micro_batches, virtual_stages)
    held = int(k * per_mb)
    recompute = cost.block_saved if checkpointing and cost.blocks else 0
    dynamic = max(held + recompute + min(grads, g_last), grads + held - per_mb + embed)
    workspace = cost.workspace + 2 * cost.kept_per_block
    return MemoryBreakdown(runtime, params, grads, optimizer, buffers, held, dynamic, workspace)
