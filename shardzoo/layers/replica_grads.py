"""Pieces of a parameter that several ranks of one axis hold alike, with their gradients summed.

Grouped-query attention with more head parts than kv heads gives each rank the kv heads its q
heads read, so ranks along the head axis hold the same kv rows (docs/parallelize.md, "Grouped-
query attention"). Each copy gets the gradient of its own q heads only; the serial gradient is
their sum. :class:`ReplicaGradSum` is the hook a layer runs its parameter through
(``ParallelModule.set_param_hook``): identity forward, and in backward one all-reduce over the
axis of a buffer with a slot per distinct piece, so every copy gets the sum of its own slot.
Summing in the autograd graph (not after backward) keeps gradient accumulation, DDP and FSDP2
exact: they see each backward's gradient already summed.
"""

from __future__ import annotations

import torch

from shardzoo.comm import ops


class _SumReplicaGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group, slot: int, slots: int):
        ctx.group, ctx.slot, ctx.slots = group, slot, slots
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.new_zeros((ctx.slots, *grad.shape))
        buf[ctx.slot] = grad
        ops.all_reduce(buf, ctx.group, inplace=True)
        return buf[ctx.slot], None, None, None


class ReplicaGradSum:
    """``hook(param)``: ``param`` in forward; its gradient summed over the ranks of ``group``
    that hold the same piece (``slot`` of ``slots`` distinct pieces along the group)."""

    def __init__(self, group, slot: int, slots: int):
        self.group, self.slot, self.slots = group, slot, slots

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if ops.group_size(self.group) == 1:
            return t
        return _SumReplicaGrads.apply(t, self.group, self.slot, self.slots)

    def __repr__(self) -> str:
        return f"ReplicaGradSum(slot={self.slot}, slots={self.slots})"


def replica_slot(offsets: tuple[int, ...], group) -> tuple[int, int, bool]:
    """(this rank's slot, number of distinct pieces, whether this rank holds the first copy of
    its piece) among the ranks of ``group``, whose pieces are told apart by their ``offsets``
    in the global tensor. Collective over ``group``."""
    mine = torch.tensor(offsets, dtype=torch.int64)
    every = ops.all_gather(mine.unsqueeze(0), group, 0).tolist() if ops.group_size(group) > 1 else [list(offsets)]
    every = [tuple(o) for o in every]
    distinct = sorted(set(every))
    me = ops.group_rank(group) if ops.group_size(group) > 1 else 0
    return distinct.index(tuple(offsets)), len(distinct), every.index(tuple(offsets)) == me
