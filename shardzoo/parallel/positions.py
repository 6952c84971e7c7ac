"""The ``position_embedding`` style: a learned position table a module of one's own indexes
with positions computed from the length it sees (``torch.arange(ids.shape[1])``).

Under sp that length is the local shard's, so index i is not the i-th token's position. The
layout's own ``embedding`` (split like the ``embedding`` style) gets a forward pre-hook that
maps each local index i to the global position of this rank's i-th token
(``shard_positions``: contiguous, or zigzag chunks r and 2P-1-r for a causal model) before the
lookup. With sp = 1 it is the plain ``embedding`` style.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers.sequence import shard_positions


class GlobalPositions:
    """Forward pre-hook: local positions [..., s] (values 0..s-1) -> the global positions of
    this sp rank's tokens, same shape."""

    def __init__(self, sp_rank: int, sp_size: int, zigzag: bool):
        self.sp_rank, self.sp_size, self.zigzag = sp_rank, sp_size, zigzag

    def __call__(self, module: nn.Module, args: tuple):
        local, rest = args[0], args[1:]
        seq_local = local.shape[-1]
        table = shard_positions(seq_local, self.sp_rank, self.sp_size, self.zigzag, device=local.device)
        if torch.is_floating_point(local) or bool(((local < 0) | (local >= seq_local)).any()):
            raise ValueError(f"a 'position_embedding' takes the local positions 0..{seq_local - 1} of the "
                             f"{seq_local} tokens it sees (torch.arange(ids.shape[1])); got values outside them. "
                             f"Plan a table of other indices as 'embedding'")
        return (table[local], *rest)

    def __repr__(self) -> str:
        return f"GlobalPositions(sp_rank={self.sp_rank}, sp_size={self.sp_size}, zigzag={self.zigzag})"


def build_position_embedding(module: nn.Embedding, tpl, zigzag: bool) -> nn.Module:
    """The layout's embedding from ``module``, its indices mapped to global positions under sp."""
    layer = tpl.embedding(serial=module, device=module.weight.device)
    mesh = tpl.mesh
    if mesh.sp_size > 1:
        layer.register_forward_pre_hook(GlobalPositions(mesh.sp_rank, mesh.sp_size, zigzag))
    return layer
