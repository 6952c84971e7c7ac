"""The ``position_embedding`` style: a learned position table a module of one's own indexes
with positions computed from the length it sees (``torch.arange(ids.shape[1])``).

Under sp that length is the local shard's, so index i is not the i-th token's position. The
layout's own ``embedding`` (split like the ``embedding`` style) gets a forward pre-hook that
maps each local index i to the global position of this rank's i-th token
(``shard_positions``: contiguous, or zigzag chunks r and 2P-1-r for a causal model) before the
lookup. With sp = 1 it is the plain ``embedding`` style.

A table may keep its first rows for something else and look position p up in row p + offset
(OPT's learned positions start at row 2): an ``nn.Embedding`` subclass with an integer
``offset`` attribute whose forward adds it. The layout's embedding does not run that forward,
so the pre-hook adds the offset too (at sp = 1 as well); the subclass's forward is probed once
at build time and refused unless it does look up row p + offset, so no other index formula is
silently replaced.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from shardzoo.layers.sequence import shard_positions

OFFSET_ATTR = "offset"


class GlobalPositions:
    """Forward pre-hook: local positions [..., s] (values 0..s-1) -> the table rows of this sp
    rank's tokens (global position + ``offset``), same shape."""

    def __init__(self, sp_rank: int, sp_size: int, zigzag: bool, offset: int = 0):
        self.sp_rank, self.sp_size, self.zigzag, self.offset = sp_rank, sp_size, zigzag, offset

    def __call__(self, module: nn.Module, args: tuple):
        local, rest = args[0], args[1:]
        seq_local = local.shape[-1]
        table = shard_positions(seq_local, self.sp_rank, self.sp_size, self.zigzag, device=local.device)
        if torch.is_floating_point(local) or bool(((local < 0) | (local >= seq_local)).any()):
            raise ValueError(f"a 'position_embedding' takes the local positions 0..{seq_local - 1} of the "
                             f"{seq_local} tokens it sees (torch.arange(ids.shape[1])); got values outside them. "
                             f"Plan a table of other indices as 'embedding'")
        return (table[local] + self.offset, *rest)

    def __repr__(self) -> str:
        return (f"GlobalPositions(sp_rank={self.sp_rank}, sp_size={self.sp_size}, zigzag={self.zigzag}, "
                f"offset={self.offset})")


def position_offset(name: str, module: nn.Embedding) -> int:
    """The row offset of position table ``module`` (its ``offset`` attribute, default 0), after
    checking that its forward looks up row p + offset for position p; raises otherwise."""
    offset = getattr(module, OFFSET_ATTR, 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < module.num_embeddings:
        raise ValueError(f"{name}.offset = {offset!r}: a 'position_embedding' offset is the integer row of position "
                         f"0, in 0..{module.num_embeddings - 1}; fix the attribute or plan the table as 'embedding'")
    if type(module).forward is nn.Embedding.forward and offset == 0:
        return 0
    probe = torch.arange(min(4, module.num_embeddings - offset))
    rows = torch.arange(module.num_embeddings, dtype=torch.float64)[:, None]  # row r holds r
    with torch.no_grad():
        got = functional_call(module, {"weight": rows}, (probe,))
    if got.shape != (len(probe), 1) or not torch.equal(got[:, 0], (probe + offset).double()):
        raise ValueError(f"{name} ({type(module).__name__}, offset={offset}) does not look position p up in row "
                         f"p + offset (positions {probe.tolist()} read rows {got.flatten().tolist()}); the "
                         f"'position_embedding' style replaces its forward by that lookup. Make its forward "
                         f"return super().forward(positions + self.offset), or plan it as 'embedding'")
    return offset


def build_position_embedding(module: nn.Embedding, mesh, zigzag: bool, make, name: str = "position table") -> nn.Module:
    """The embedding ``make(plain nn.Embedding)`` builds from ``module``, its indices mapped to
    global positions under sp and shifted by the table's offset (module doc)."""
    offset = position_offset(name, module)
    layer = make(_plain_table(module))
    if mesh.sp_size > 1 or offset:
        layer.register_forward_pre_hook(GlobalPositions(mesh.sp_rank, mesh.sp_size, zigzag, offset))
    return layer


def _plain_table(module: nn.Embedding) -> nn.Embedding:
    """``module`` as a plain nn.Embedding sharing its weight: a layout that keeps the serial
    module (1d replicates it) must not run a subclass's forward, whose offset the hook adds."""
    if type(module) is nn.Embedding:
        return module
    plain = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, module.max_norm,
                         module.norm_type, module.scale_grad_by_freq, module.sparse, device="meta")
    plain.weight = module.weight
    return plain
