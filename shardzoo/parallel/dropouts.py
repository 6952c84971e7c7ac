"""The ``dropout`` style: an ``nn.Dropout`` replaced by the layout's dropout.

A plain ``nn.Dropout`` draws from torch's generator on each rank on its own; on an activation
that is replicated over tp that is the same mask on every tp rank only while every rank has
drawn exactly the same numbers before, and the replicas drift apart silently once they have
not. ``layout_of(mesh).dropout`` draws from the mesh's streams (layers/random.py): the default
stream, kept equal over tp, where the activation is replicated (1d between blocks), the per-rank
tp stream where it is split (the grids). Between sequence-sharded 1d blocks (megatron_sp.py)
it drops this rank's chunk of the sequence with that chunk of the whole activation's mask.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers.tensor_layout import layout_of


def is_dropout(module: nn.Module) -> bool:
    """torch's dropout modules (Dropout, Dropout1d/2d/3d, AlphaDropout, ...)."""
    return isinstance(module, nn.modules.dropout._DropoutNd)


class LayoutDropout(nn.Module):
    """``layout_of(mesh).dropout(x, p, self.training)``: any shape -> same shape; follows
    ``.train()`` / ``.eval()`` as ``nn.Dropout`` does."""

    def __init__(self, p: float, mesh):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} must be in [0, 1]")
        self.p, self.mesh = p, mesh
        self.sequence = None  # the model's SequenceShards when x is this rank's chunk of the sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None and self.training and self.p > 0 and self.sequence.holds_chunk(x):
            return self.sequence.dropout(x, self.p)
        return layout_of(self.mesh).dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, tp_mode={layout_of(self.mesh).mode!r}"


def build_dropout(module: nn.Dropout, mesh) -> LayoutDropout:
    """The layout's dropout with ``module``'s p and train / eval mode."""
    layer = LayoutDropout(module.p, mesh)
    layer.train(module.training)
    return layer
