"""ParallelLinear2p5D (Tesseract): the 2D SUMMA layer on a depth-d grid, tp = d*q*q.

Depth slice k (tp_dep = k) holds batch blocks k*q .. k*q+q-1 and runs the 2D SUMMA of
linear_2d.py on them with the same weight blocks, which are replicated over tp_dep. Their
gradients are summed over tp_dep in backward (one all-reduce of the weight block), so every
depth replica steps identically. With d = 1 this is exactly ParallelLinear2D.
"""

from __future__ import annotations

from shardzoo.layers.linear_2d import SummaLinearBase


class ParallelLinear2p5D(SummaLinearBase):
    """2.5D (Tesseract) linear layer; drop-in for ``nn.Linear`` on a tp_mode="2.5d" mesh.

    Args: as nn.Linear, plus ``mesh`` (tp = d*q*q). in_features and out_features must be
    divisible by q. Input / output: the 2.5D layout [B/(d*q), ..., features/q] (batch over
    tp_dep*tp_row, features over tp_col)."""

    mode = "2.5d"
