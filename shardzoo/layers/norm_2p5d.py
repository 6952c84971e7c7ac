"""LayerNorm / RMSNorm on the 2.5D layout: x [B/(d*q), ..., H/q], hidden over tp_col (see norm_2d.py)."""

from __future__ import annotations

from shardzoo.layers.norm_2d import GridLayerNorm, GridRMSNorm


class LayerNorm2p5D(GridLayerNorm):
    """LayerNorm on the 2.5D layout; drop-in for ``nn.LayerNorm(H)`` on a tp_mode="2.5d" mesh.
    Statistics all-reduced over tp_col; weight / bias gradients summed over tp_dep and tp_row.
    Shapes: [B/(d*q), ..., H/q] -> same."""

    mode = "2.5d"


class RMSNorm2p5D(GridRMSNorm):
    """RMSNorm on the 2.5D layout; drop-in for ``nn.RMSNorm(H)`` on a tp_mode="2.5d" mesh.
    Shapes: [B/(d*q), ..., H/q] -> same."""

    mode = "2.5d"
