"""The ``dropout`` style: an ``nn.Dropout`` replaced by the layers' ``ParallelDropout``.

A plain ``nn.Dropout`` draws from torch's generator on each rank on its own; on an activation
that is replicated over tp that is the same mask on every tp rank only while every rank has
drawn exactly the same numbers before, and the replicas drift apart silently once they have
not. ``ParallelDropout`` (layers/rng_streams.py) draws from the mesh's streams, where the layout says
its activations between blocks are: the default stream, kept equal over tp, where they are
replicated (1d), the per-rank tp stream where they are split (the grids; the layout's
``parallel_region``).
"""

from __future__ import annotations

from torch import nn

from shardzoo.layers.rng_streams import ParallelDropout
from shardzoo.layers.tensor_layout import layout_of


def is_dropout(module: nn.Module) -> bool:
    """torch's dropout modules (Dropout, Dropout1d/2d/3d, AlphaDropout, ...)."""
    return isinstance(module, nn.modules.dropout._DropoutNd)


def build_dropout(module: nn.Dropout, mesh) -> ParallelDropout:
    """``ParallelDropout`` with ``module``'s p and train / eval mode, drawing as the mesh's
    layout does between blocks (``TensorLayout.dropout``): any shape -> same shape."""
    layer = ParallelDropout(module.p, mesh=mesh, parallel_region=layout_of(mesh).parallel_region)
    layer.train(module.training)
    return layer
