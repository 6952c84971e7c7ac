"""Inner widths tp does not divide: a column / row pair padded with zeros.

The inner width n of a column -> row pair (an MLP's intermediate size, transformers' tp tester
uses 37) is cut by the layout into B contiguous blocks (1d: tp; 2d / 2.5d: q; 3d: q*q, the
column layer's ``column_blocks``). Where B does not divide n, the pair is built from serial
layers padded to n_pad = ceil(n / B) * B: zero rows of the column's weight and bias, zero
columns of the row's weight. That is exact: a padded feature of the column's output is 0, and
whatever the model's code makes of it (act(0) * 0 for a gated MLP), the row multiplies it by a
zero column. A forward pre-hook on the row layer sets the padded input features to 0 on the
ranks that hold some, so their gradients are 0 too and the padding stays zero under any
optimizer, whatever the activation does at 0.

The ShardSpecs keep the serial tensor's shape n: the rectangle a rank holds runs past its end
(as vocabulary padding does), so ``full_state_dict``, checkpoints and ``save_pretrained`` give
the unpadded tensors and loading fills the padding with zeros.

The other side of each layer is the hidden size, which norms reduce over and the grids split
over q: zero padding there would change every norm, so a hidden size the layout does not divide
is refused by name (:func:`check_hidden`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shardzoo.layers.module import linear_from
from shardzoo.layers.shard_spec import get_shard_spec, set_shard_spec

INNER_DIM = {"column": 0, "row": 1}  # the padded dim of the [out, in] weight


def inner_width(module: nn.Linear, style: str) -> int:
    """The pair's inner width: a column's out_features, a row's in_features."""
    return module.out_features if style == "column" else module.in_features


def padded_width(n: int, layout) -> int:
    """``n`` rounded up to a multiple of the layout's column blocks."""
    blocks = layout.column_blocks()
    return -(-n // blocks) * blocks


def check_hidden(name: str, module: nn.Linear, style: str, layout) -> None:
    """Refuse a hidden side (a column's in_features, a row's out_features) the layout cannot
    split: zero padding would enter the norms over the hidden size."""
    if layout.mode == "1d":
        return  # 1d keeps the hidden size whole between the pairs
    side, size = ("in_features", module.in_features) if style == "column" else ("out_features", module.out_features)
    parts = layout.mesh.q if style == "column" else layout.column_blocks()
    if size % parts:
        up = -(-size // parts) * parts
        raise ValueError(f"{name} ({style}) has {side}={size}, the hidden size, which the {layout.mode} layout splits "
                         f"into {parts} blocks; a hidden size cannot be padded (the norms reduce over it). Use a "
                         f"hidden size that is a multiple of {parts} (e.g. {up}) or a tp whose q divides {size}")


def build_padded(module: nn.Linear, style: str, layout, make) -> nn.Module:
    """The ``style`` layer for the serial ``module`` (an [out, in] nn.Linear) with its inner
    width zero-padded to :func:`padded_width`, built by ``make(serial nn.Linear)``; specs of
    the unpadded tensors."""
    dim = INNER_DIM[style]
    n = inner_width(module, style)
    extra = padded_width(n, layout) - n
    weight = _pad(module.weight, dim, extra)
    bias = module.bias if module.bias is None or style == "row" else _pad(module.bias, 0, extra)
    layer = make(linear_from(weight, bias))
    for pname, pdim in (("weight", dim), ("bias", 0 if style == "column" else None)):
        spec = get_shard_spec(layer, pname)
        if spec is not None and pdim is not None:
            shape = list(spec.global_shape)
            shape[pdim] = n
            set_shard_spec(layer, pname, dataclasses.replace(spec, global_shape=tuple(shape)))
    if style == "row":
        _zero_padded_inputs(layer, n, layout)
    return layer


def _pad(t: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.detach(), t.new_zeros(shape)], dim)


def _zero_padded_inputs(layer: nn.Module, n: int, layout) -> None:
    """On a rank whose input block holds padded features, a pre-hook sets them to 0."""
    axis = getattr(layer, "placement", layout.activation).hidden_axis
    width = layer.in_features // layout.mesh.size(axis)
    valid = max(0, min(width, n - layout.mesh.rank(axis) * width))
    if valid == width:
        return
    padded = torch.arange(width) >= valid

    def hook(module, args):
        x = args[0]
        return (x.masked_fill(padded.to(x.device), 0), *args[1:])

    layer.register_forward_pre_hook(hook)
