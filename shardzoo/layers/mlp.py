"""Transformer MLP ``fc2(act(fc1(x)))`` on any tp_mode (Megatron column -> row pair in 1D).

In 3D the second projection consumes the first one's output layout, so the MLP starts and ends
in the same layout and residual adds line up (linear_3d.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.layers.tensor_layout import layout_of

ACTIVATIONS = {
    "gelu": F.gelu,  # erf GeLU (BERT, ViT)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,  # OPT
}


def activation(name: str):
    """The element-wise activation named as in HF configs (``hidden_act`` / ``activation_function``)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """``fc2(act(fc1(x)))`` with tensor-parallel projections.

    Args:
        hidden_size, ffn_size: H and the inner size F.
        mesh: ParallelMesh; act: activation name (``ACTIVATIONS``); bias: on both projections.
        layout: input activation layout (None: the mode's canonical one).
        device, dtype: of the parameters (serial init order: fc1, fc2).

    Shapes: x [b, s, H_l] -> [b, s, H_l]; the inner activation is [b, s, F/tp] (1D) or
    [b, s, F/q] (grid modes), elementwise ops on it need no communication.
    """

    def __init__(self, hidden_size: int, ffn_size: int, *, mesh, act: str = "gelu", bias: bool = True,
                 layout=None, device=None, dtype=None, _serial: tuple[nn.Linear, nn.Linear] | None = None):
        super().__init__()
        self.act_name, self.act = act, activation(act)
        tpl = layout_of(mesh)
        layout = layout or tpl.activation
        fc1, fc2 = _serial or (nn.Linear(hidden_size, ffn_size, bias, dtype=dtype),
                               nn.Linear(ffn_size, hidden_size, bias, dtype=dtype))
        self.fc1 = tpl.linear(serial=fc1, style="column", layout=layout, device=device)
        self.fc2 = tpl.linear(serial=fc2, style="row", layout=tpl.after(self.fc1, layout), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def extra_repr(self) -> str:
        return f"act={self.act_name!r}"
