"""LayerNorm / RMSNorm on a 3D layout (I, J | L): x [B/q^2, ..., H/q], hidden over L (see norm_2d.py).

Pass ``placement=`` the producing layer's ``output_placement`` when the input is not in the canonical
(tp_x, tp_y | tp_z) placement.
"""

from __future__ import annotations

from shardzoo.layers.norm_2d import GridLayerNorm, GridRMSNorm


class LayerNorm3D(GridLayerNorm):
    """LayerNorm on a 3D layout; drop-in for ``nn.LayerNorm(H)`` on a tp_mode="3d" mesh.
    Statistics all-reduced over the placement's hidden axis; weight / bias gradients summed over
    its two batch axes. Shapes: [B/q^2, ..., H/q] -> same."""

    mode = "3d"


class RMSNorm3D(GridRMSNorm):
    """RMSNorm on a 3D layout; drop-in for ``nn.RMSNorm(H)`` on a tp_mode="3d" mesh.
    Shapes: [B/q^2, ..., H/q] -> same."""

    mode = "3d"
