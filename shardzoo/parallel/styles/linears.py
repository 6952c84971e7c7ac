"""The linear styles: 'column' / 'row' (a Megatron pair), 'packed_column' (GPT-2's q|k|v
``c_attn``, a fused gate|up), 'head_fused_column' (Megatron's fused QKV, head by head) and
'dense' (a projection whose output stays in its input's placement). Each takes an ``nn.Linear``
or transformers' ``Conv1D`` (weight [in, out], kept in that storage: linears.py).

A column layer of grouped-query attention with more head parts than kv heads is built with
its kv heads repeated (linears.py ``build_repeated_kv``), and an inner width the layout does
not divide is zero-padded (padding.py); both build through the style's own ``layers``.
"""

from __future__ import annotations

from torch import nn

from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.linear_2d import ParallelLinear2D
from shardzoo.layers.linear_2p5d import ParallelLinear2p5D
from shardzoo.layers.linear_3d import ParallelLinear3D
from shardzoo.parallel import linears, padding
from shardzoo.parallel.dense import BackToPlacement
from shardzoo.parallel.kinds import is_conv1d, is_linear
from shardzoo.parallel.styles.base import Build, Layer, Style, Whole, canonical


def _row_input(ctx: Build) -> dict:
    """A row layer reads the column layer's output placement (3D swaps two axes)."""
    return {"placement": ctx.layout.linear_output(ctx.layout.activation)}


class Column(Style):
    """First of a pair: [b, s, H_l] -> [b, s, n_l], the output features split over the head axis."""

    name = "column"
    on_sequence_chunks = True
    needs = "an nn.Linear or a Conv1D"
    split = "column"  # the side of the pair, for padding.py
    layers = {"1d": Layer(ParallelLinear1D, lambda ctx: {"style": "column"}),
              "2d": Layer(ParallelLinear2D, canonical), "2.5d": Layer(ParallelLinear2p5D, canonical),
              "3d": Layer(ParallelLinear3D, canonical)}

    def accepts(self, module: nn.Module) -> bool:
        return is_linear(module)

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        name, layout = ctx.name, ctx.layout
        owner = next((a for a in ctx.attention.values() if name in a.kv_projections), None)
        make = lambda serial: self.layer(serial, ctx)  # noqa: E731
        if owner is not None and owner.replicated_kv:
            return linears.build_repeated_kv(name, module, layout, owner, make)
        serial = linears.serial_linear(module)
        padding.check_hidden(name, serial, self.split, layout)
        # an MLP's intermediate: zero padding is exact
        if padding.inner_width(serial, self.split) % layout.column_blocks():
            layer = padding.build_padded(serial, self.split, layout, make)
        else:
            layer = make(serial)
        if is_conv1d(module):
            linears.as_conv1d_storage(layer)
        return layer


class Row(Column):
    """Second of a pair: [b, s, n_l] -> [b, s, H_l] in the block's placement."""

    name = "row"
    split = "row"
    layers = {"1d": Layer(ParallelLinear1D, lambda ctx: {"style": "row"}),
              "2d": Layer(ParallelLinear2D, _row_input), "2.5d": Layer(ParallelLinear2p5D, _row_input),
              "3d": Layer(ParallelLinear3D, _row_input)}


class PackedColumn(Column):
    """A column layer whose output packs K equal parts, each split like a column layer's."""

    name = "packed_column"

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        owner = next((a for a in ctx.attention.values() if ctx.name in a.packed), None)
        parts = owner.packed[ctx.name] if owner is not None else 2
        return linears.build_packed(module, parts, ctx.layout, lambda serial: self.layer(serial, ctx))


class HeadFusedColumn(Column):
    """Output rows grouped by head (head, q|k|v, head_dim): any contiguous split holds whole
    heads, so it is split as a plain column layer."""

    name = "head_fused_column"

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        layer = self.layer(linears.serial_linear(module), ctx)
        if is_conv1d(module):
            linears.as_conv1d_storage(layer)
        return layer


class Dense(Column):
    """[b, ..., in_l] -> [b, ..., out_l], both in the layout's activation placement: replicated in
    1d, a grid linear in the grids (its output moved back where 3D swaps the axes)."""

    name = "dense"
    on_sequence_chunks = False  # replicated in 1d: its gradient would cover this rank's tokens only
    layers = {"1d": Layer(Whole), "2d": Layer(ParallelLinear2D, canonical),
              "2.5d": Layer(ParallelLinear2p5D, canonical), "3d": Layer(ParallelLinear3D, canonical)}

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        layer = self.layer(linears.serial_linear(module), ctx)
        layout = ctx.layout
        if layout.after(layer, layout.activation) != layout.activation:
            layer.register_forward_hook(BackToPlacement(layout))
        return layer
