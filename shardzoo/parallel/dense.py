"""The ``dense`` style: an ``nn.Linear`` whose output stays in its input's activation layout
(BERT's pooler and MLM transform, OPT's project_in / project_out), where a column / row pair
does not fit because nothing follows it to undo the split.

The layout builds it (``TensorLayout.dense``: replicated in 1d, a grid linear in 2d / 2.5d /
3d), and a forward hook moves the output back to the input's layout where the layout's linear
leaves it in another one (3D swaps the batch and hidden axes; ``TensorLayout.relayout`` moves it back).
"""

from __future__ import annotations

from torch import nn

from shardzoo.parallel.linears import serial_linear


class BackToLayout:
    """Forward hook: the dense layer's output, in the layout its input had."""

    def __init__(self, tpl):
        self.tpl = tpl

    def __call__(self, module: nn.Module, args: tuple, output):
        layout = self.tpl.activation
        return self.tpl.relayout(output, self.tpl.after(module, layout), layout)


def build_dense(module: nn.Module, tpl) -> nn.Module:
    """The layout's dense projection from ``module`` (nn.Linear or Conv1D): x [b, ..., in_l] ->
    [b, ..., out_l], both in the layout's activation layout."""
    layer = tpl.dense(serial=serial_linear(module), device=module.weight.device)
    if tpl.mode != "1d":  # 1d's dense layer is the replicated nn.Linear itself
        layer.register_forward_hook(BackToLayout(tpl))
    return layer
