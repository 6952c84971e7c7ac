"""Partial gradients summed over tp in one call per block (Megatron sequence parallelism).

Between sequence-sharded blocks each tp rank's norms and row-layer biases see only its own
tokens, so their gradients are partial and backward must add them over tp. One all-reduce per
parameter is a call each (a GPT-2 block has six), and where a collective call costs a fixed
latency (gloo on a CPU host) those calls cost more than the bytes. Instead, a block's forward
pre-hook passes all of them through one autograd node (:class:`PartialGrads`); autograd runs
that node once every use inside the block has its gradient, and it sums them all with one
all-reduce of their concatenation, before they are accumulated.

A module reads such a parameter through :meth:`PartialGrads.summed`: the node's output while
its block runs, else the per-parameter sum (``common_1d.tp_sum_grad``), so a module called on its own
stays exact. Activation checkpointing replaces a block's ``forward``, so the hooks run outside
the recomputed region and the node is made once per forward. Under FSDP2 (``data_parallel``
with zero >= 2) the block's own pre-forward hook runs first (it is registered with prepend),
so the parameters read here are the unsharded ones; a parameter swapped since the node was made
falls back to its own sum.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.comm import ops
from shardzoo.layers.common_1d import tp_sum_grad


class _SumOverGroup(torch.autograd.Function):
    """Identity forward on every parameter; backward sums all their gradients over ``group``
    in one all-reduce per dtype."""

    @staticmethod
    def forward(ctx, group, *params):
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        out = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = ops.all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.group, inplace=True)
            for i, piece in zip(idx, flat.split([grads[i].numel() for i in idx])):
                out[i] = piece.view_as(grads[i])
        return (None, *out)


class PartialGrads:
    """The parameters inside one model's sequence-sharded blocks whose gradients are partial
    over tp (module doc), summed once per block."""

    def __init__(self, mesh):
        self.mesh = mesh
        # False: one sum per parameter. The zero-bubble pipeline schedules compute weight
        # gradients group by group from a split backward, and a node shared by a block's
        # parameters would run once per group (shardzoo/parallel/pipelined.py).
        self.merged = True
        self._open: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None

    def summed(self, module: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
        """``param`` (``module``'s parameter ``name``, as forward uses it) with its gradient
        summed over tp: through the running block's node when it holds this very tensor."""
        entry = None if self._open is None else self._open.get((id(module), name))
        if entry is not None and entry[0] is param:
            return entry[1]
        return tp_sum_grad(param, self.mesh, True)

    def hook_block(self, block: nn.Module, members: list[tuple[nn.Module, str]]) -> None:
        """Sum the gradients of ``members`` ((module, parameter name) inside ``block``) in one
        call per forward of ``block``."""
        if members and self.mesh.tp_size > 1:
            block.register_forward_pre_hook(_Open(self, members))
            block.register_forward_hook(_Close(self))


class _Open:
    def __init__(self, grads: PartialGrads, members: list[tuple[nn.Module, str]]):
        self.grads, self.members = grads, members

    def __call__(self, block, args):
        if not self.grads.merged:
            return
        params = [getattr(m, n) for m, n in self.members]
        outs = _SumOverGroup.apply(self.grads.mesh.tp_group, *params)
        self.grads._open = {(id(m), n): (p, o) for (m, n), p, o in zip(self.members, params, outs)}


class _Close:
    def __init__(self, grads: PartialGrads):
        self.grads = grads

    def __call__(self, block, args, output):
        self.grads._open = None
