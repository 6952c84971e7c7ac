"""The ``dense`` style: an ``nn.Linear`` whose output stays in its input's activation placement
(BERT's pooler and MLM transform, OPT's project_in / project_out), where a column / row pair
does not fit because nothing follows it to undo the split.

The style builds it (styles/linears.py ``Dense``: replicated in 1d, a grid linear in 2d / 2.5d /
3d), and the forward hook here moves the output back to the input's placement where the grid's
linear leaves it in another one (3D swaps the batch and hidden axes; ``TensorLayout.change_placement`` moves it back).
"""

from __future__ import annotations

from torch import nn


class BackToPlacement:
    """Forward hook: the dense layer's output, in the placement its input had."""

    def __init__(self, layout):
        self.layout = layout

    def __call__(self, module: nn.Module, args: tuple, output):
        placement = self.layout.activation
        return self.layout.change_placement(output, self.layout.after(module, placement), placement)
