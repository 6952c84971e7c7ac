"""One pipeline stage of a model as cost pieces, whatever the model: what one rank of a stage
runs per micro-batch (``StageCost``: the embeddings on the first stage, one block repeated
``blocks`` times, the head with its loss on the last), built from the ``StageParts`` a model
shape prices for a layout (walked.ModelShape: walk.py reads the model and its plan,
walk_pieces.py prices each module by the layout's cost object, planner/block_costs.py).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from functools import cached_property

from shardzoo.planner.block_costs import Illegal, Piece, calls, elementwise
from shardzoo.models.common import stage_blocks


NOTHING = Piece()  # what a stage without the embeddings (or the head) holds of them


def _by_size(pairs) -> tuple[tuple[int, int], ...]:
    """(tensor bytes, element passes) pairs summed per tensor size."""
    out: dict[int, int] = {}
    for size, n in pairs:
        out[size] = out.get(size, 0) + n
    return tuple(out.items())


@dataclass
class StageCost:
    """One rank of one pipeline stage, per micro-batch (``first`` / ``last``: zero Pieces on
    the other stages); ``block`` is one transformer block, run ``blocks`` times."""

    first: Piece
    block: list[Piece]
    blocks: int
    last: Piece
    boundary: int  # bytes of the activation this stage sends forward (and receives as gradient)
    tied_table: int  # parameter elements of the tied table synchronised with the other end (0: none)
    is_first: bool = True
    is_last: bool = True
    block_params: list[int] = field(default_factory=list)  # elements per block, for FSDP2 units
    block_input: int | None = None  # bytes of a block's input, which checkpointing keeps (None: boundary)

    @property
    def kept_per_block(self) -> int:
        """Bytes activation checkpointing keeps per block: its input (a sequence chunk under
        Megatron sequence parallelism, where the stage boundary is the whole activation)."""
        return self.boundary if self.block_input is None else self.block_input

    @cached_property
    def params(self) -> int:
        return self.first.params + self.blocks * sum(p.params for p in self.block) + self.last.params

    @cached_property
    def block_edp_params(self) -> int:
        """Parameter elements of one block averaged over edp (its experts split over ep)."""
        return sum(p.edp_params for p in self.block)

    @cached_property
    def edp_params(self) -> int:
        """Of ``params``: the experts split over ep (every block's; the ends hold none)."""
        return self.blocks * self.block_edp_params

    @cached_property
    def edp_tensors(self) -> int:
        return self.blocks * sum(p.edp_tensors for p in self.block)

    @cached_property
    def tensors(self) -> int:
        """Parameter tensors of the stage (ZeroRedundancyOptimizer broadcasts them one by one)."""
        return self.first.tensors + self.blocks * sum(p.tensors for p in self.block) + self.last.tensors

    @cached_property
    def block_modules(self) -> int:
        """Module calls of one block's forward."""
        return sum(p.modules for p in self.block)

    @cached_property
    def modules(self) -> int:
        """Module calls of the stage's forward, one micro-batch."""
        return self.first.modules + self.blocks * self.block_modules + self.last.modules

    @cached_property
    def block_saved(self) -> int:
        """Activation bytes one block keeps for backward."""
        return sum(p.saved for p in self.block)

    @cached_property
    def block_work(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """(matmul FLOPs, attention FLOPs, elementwise passes as (tensor bytes, element passes)
        pairs) of one block, forward (elementwise: forward + backward)."""
        return (sum(p.flops for p in self.block), sum(p.attn_flops for p in self.block),
                _by_size(w for p in self.block for w in p.elementwise))

    @cached_property
    def work(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """The same for the whole stage and one micro-batch."""
        ends = (self.first, self.last)
        flops, attn, block = self.block_work
        elementwise = [(size, self.blocks * n) for size, n in block] + [w for p in ends for w in p.elementwise]
        return (self.blocks * flops + sum(p.flops for p in ends), self.blocks * attn + sum(p.attn_flops for p in ends),
                _by_size(elementwise))

    @cached_property
    def workspace(self) -> int:
        """The largest transient of any piece of the stage."""
        return max(p.workspace for p in (self.first, self.last, *self.block))


@dataclass(frozen=True)
class Batch:
    """What one micro-batch looks like on this rank's tp x sp group."""

    rows: int  # micro-batch rows (sequences) per dp replica
    seq: int  # full sequence length
    sp: int
    sp_mode: str
    e: int  # bytes per activation element
    training: bool = True
    mask_bytes: int = 1  # per element of a dropout mask: bool on CUDA, the activation dtype on CPU
    attention: str = "flash"  # the attention kernel (comm.ATTENTION_KERNELS)
    chunks: int = 1  # Megatron sequence parallelism: the sequence chunks between the blocks' tp layers (1: off)
    ep: int = 1  # ranks the experts of a MoE layer are split over (ParallelMesh's ep)


DROPOUT_PASSES, GELU_PASSES, RELU_PASSES, ADD_PASSES = 5, 4, 2, 2  # elementwise passes, fwd + bwd


def dropout(p: float, n: int, b: "Batch") -> Piece:
    """F.dropout keeps a mask of the ``n`` elements it drops from (bool on CUDA; on CPU the
    scaled noise tensor, in the activation dtype)."""
    on = b.training and p > 0
    return Piece([], 0, n * b.mask_bytes if on else 0, **elementwise(DROPOUT_PASSES, n if on else 0, b.e))


LOSS_PAIR_BYTES = 16  # model.loss all-reduces [sum, count] in fp64
COUNT_BYTES = 8  # count_targets all-reduces one int64


def target_axes(shape, costs, dp: int, sp: int) -> list[tuple[str, int]]:
    """(axis, size) of the mesh axes the targets are split over (layers/batch_loss.py): dp, sp
    (not for a pooled head, whose targets every sp rank holds) and the batch axes of the
    head's layout."""
    placement = costs.canonical
    batch = [(a, costs.size(a)) for a in placement.batch_axes] if placement is not None else []
    return [("dp", dp)] + ([] if shape.pooled else [("sp", sp)]) + batch


def loss_reduction(axes: list[tuple[str, int]], payload: int, pp: int, phase: str = "fwd") -> list:
    """The global-mean loss's all-reduce of ``payload`` bytes over the target axes: one call
    over their combined group, or one per axis on a pipeline's last stage."""
    axes = [(a, n) for a, n in axes if n > 1]
    if pp == 1:
        return calls(phase, tuple(a for a, _ in axes), "all_reduce", payload, math.prod(n for _, n in axes)) if axes else []
    return [c for a, n in axes for c in calls(phase, (a,), "all_reduce", payload, n)]


@dataclass
class StageParts:
    """The pieces every stage of a layout is made of, for one micro-batch size."""

    first: Piece
    block: list[Piece]
    last: Piece  # the head with its own table
    last_tied: Piece  # the head sharing the embedding's table (first and last stage in one)
    boundary: int
    table: int  # parameter elements of the vocabulary table (0: no tied table)
    enters: Piece = field(default_factory=Piece)  # what every stage runs before its blocks (rotary tables)
    leaves: Piece = field(default_factory=Piece)  # what the last stage runs after them (leaving the chunks)
    block_input: int | None = None  # bytes of a block's input (a sequence chunk); None: the boundary
    enter: Piece = field(default_factory=Piece)  # what the first stage runs before them (entering the chunks)


def assemble(shape, parts: StageParts, stage: int = 0, stages: int = 1) -> StageCost:
    """Stage ``stage`` of ``stages`` from its parts."""
    try:
        blocks, is_first, is_last = stage_blocks(shape.family, shape.layers, (stage, stages) if stages > 1 else None,
                                                 None)
    except ValueError as err:
        raise Illegal(str(err)) from None
    first = (parts.first + parts.enter if is_first else NOTHING) + parts.enters
    last = ((parts.last_tied if is_first else parts.last) + parts.leaves if is_last else NOTHING)
    table = parts.table if stages > 1 and (is_first or is_last) else 0
    return StageCost(first, parts.block, len(blocks), last, parts.boundary, table, is_first, is_last,
                     [sum(p.params for p in parts.block)] * len(blocks), parts.block_input)
