"""One entry point per building block for every tp_mode, so attention, MLP and model code is
written once: ``tp_linear``, ``tp_layer_norm``, ``shard_hidden`` / ``gather_hidden``,
``shard_rows`` / ``gather_rows``.

A *layout* is ``None`` in 1D (activations ``[B, S, H]`` replicated over tp) and an
:class:`~shardzoo.layers.layouts.ActivationLayout` in 2D / 2.5D / 3D (``[B/parts, S, H/q]``).
Layers are built from a serial module (``nn.Linear``, ``nn.LayerNorm``) whose weights every
rank holds, so parallel init equals serial init (DESIGN principle 4).
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers import layouts
from shardzoo.layers.layouts import ActivationLayout
from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.linear_2d import ParallelLinear2D
from shardzoo.layers.linear_2p5d import ParallelLinear2p5D
from shardzoo.layers.linear_3d import ParallelLinear3D
from shardzoo.layers.norm import LayerNorm1D
from shardzoo.layers.norm_2d import LayerNorm2D
from shardzoo.layers.norm_2p5d import LayerNorm2p5D
from shardzoo.layers.norm_3d import LayerNorm3D

_GRID_LINEAR = {"2d": ParallelLinear2D, "2.5d": ParallelLinear2p5D}
_GRID_NORM = {"2d": LayerNorm2D, "2.5d": LayerNorm2p5D, "3d": LayerNorm3D}


def input_layout(mesh) -> ActivationLayout | None:
    """The layout a model's first layer consumes: None in 1D, the canonical one otherwise."""
    return None if mesh.tp_mode == "1d" else layouts.canonical_layout(mesh)


def tp_linear(serial: nn.Linear, mesh, layout: ActivationLayout | None, style: str, device=None) -> nn.Module:
    """This rank's piece of ``serial`` as the mode's linear layer.

    ``style`` matters in 1D only ("column": split out_features, "row": split in_features, the
    input being a column layer's output); the grid layers split both dims. ``layout`` is the
    input layout (3D chains: pass the previous layer's ``output_layout``)."""
    if mesh.tp_mode == "1d":
        return ParallelLinear1D.from_serial(serial, mesh, style=style, device=device)
    if mesh.tp_mode == "3d":
        return ParallelLinear3D.from_serial(serial, mesh, device=device, input_layout=layout)
    return _GRID_LINEAR[mesh.tp_mode].from_serial(serial, mesh, device=device)


def layout_after(module: nn.Module, layout: ActivationLayout | None) -> ActivationLayout | None:
    """The activation layout ``module`` produces when it consumes ``layout``."""
    return getattr(module, "output_layout", layout) if layout is not None else None


def tp_layer_norm(serial: nn.LayerNorm, mesh, layout: ActivationLayout | None, device=None) -> nn.Module:
    """``serial`` as the mode's LayerNorm for activations in ``layout``."""
    if mesh.tp_mode == "1d":
        return LayerNorm1D.from_serial(serial, mesh, device=device)
    return _GRID_NORM[mesh.tp_mode].from_serial(serial, mesh, device=device, layout=layout)


def shard_hidden(x_full: torch.Tensor, mesh, layout: ActivationLayout | None) -> torch.Tensor:
    """[B, ..., H] replicated -> this rank's block in ``layout`` (1D: unchanged)."""
    return x_full if layout is None else layouts.shard_activation(x_full, mesh, layout)


def gather_hidden(y_local: torch.Tensor, mesh, layout: ActivationLayout | None) -> torch.Tensor:
    """This rank's block in ``layout`` -> [B, ..., H] on every rank (1D: unchanged)."""
    return y_local if layout is None else layouts.gather_activation(y_local, mesh, layout)


def shard_rows(t_full: torch.Tensor, mesh, layout: ActivationLayout | None) -> torch.Tensor:
    """Split only dim 0 (batch) as ``layout`` does: ids, masks, targets, images (1D: unchanged)."""
    return t_full if layout is None else layouts.shard_batch(t_full, mesh, layout)


def gather_rows(t_local: torch.Tensor, mesh, layout: ActivationLayout | None) -> torch.Tensor:
    """Inverse of :func:`shard_rows`."""
    return t_local if layout is None else layouts.gather_batch(t_local, mesh, layout)


def head_axis(mesh, layout: ActivationLayout | None) -> tuple[str, int]:
    """(mesh axis splitting the heads, its size) for activations in ``layout``."""
    if layout is None:
        return "tp", mesh.tp_size
    return layout.hidden_axis, mesh.size(layout.hidden_axis)


def block_offsets(mesh, layout: ActivationLayout | None, local_batch: int, local_heads: int) -> tuple[int, int]:
    """(global index of this rank's first batch row, of its first head) for activations
    ``[local_batch, ..., local_heads * head_dim]`` in ``layout`` (1D: batch whole, heads over tp)."""
    if layout is None:
        return 0, mesh.tp_rank * local_heads
    return layout.batch_index(mesh) * local_batch, mesh.rank(layout.hidden_axis) * local_heads
