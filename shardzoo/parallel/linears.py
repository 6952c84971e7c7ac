"""The layout's linear layer for a planned ``nn.Linear`` or transformers ``Conv1D``: plain
column / row pairs, kv heads repeated for grouped-query attention (heads.py), and packed
projections.

The layer is always built by the layout object from a serial ``nn.Linear``; what differs is
how its parameters are stored, so that every piece is one rectangle of the serial tensor (its
ShardSpec) and ``full_state_dict`` / checkpoints give the model's own names and shapes. The
layer reads them through a parameter hook (``ParallelModule.set_param_hook``):

* ``Conv1D`` keeps its [in, out] storage; the hook transposes.
* A packed projection (``packed_column``: GPT-2's ``c_attn`` packs q|k|v, a fused gate|up
  packs two) of K parts, each n wide, cut by the layout into B blocks: the layer is built from
  the serial weight with its rows regrouped block by block ([K, B, n/B] -> [B, K, n/B]), so
  block b holds part k's rows b of every part. Each rank stores its rows as [K, n/B, in] (a
  rectangle of the serial weight seen as [K, n, in]; ShardSpec.serial_shape = [K n, in]) and
  the hook gives the layer its [K n/B, in]. Where a rank's output holds several blocks (3D
  gathers the q sub-blocks of a head group), a forward hook regroups its features from
  (block, part) to (part, block) order, so the model's ``split`` into parts sees
  [q | k | v] of this rank's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers.module import linear_from
from shardzoo.layers.replica_grads import ReplicaGradSum, replica_slot
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec, mark_repeated_copy, set_shard_spec
from shardzoo.parallel.kinds import is_conv1d


def serial_linear(module: nn.Module, weight: torch.Tensor | None = None, bias=None) -> nn.Linear:
    """An nn.Linear holding ``module``'s weight in [out, in] (a Conv1D's transposed), or the
    given ``weight`` / ``bias``."""
    if weight is None:
        weight = module.weight.t() if is_conv1d(module) else module.weight
        bias = module.bias
    return linear_from(weight, bias)


class _Chain:
    """Parameter hooks applied in order (storage -> what the layer computes with)."""

    def __init__(self, *hooks):
        self.hooks = [h for h in hooks if h is not None]

    def __call__(self, t):
        for hook in self.hooks:
            t = hook(t)
        return t


def _add_hook(layer: nn.Module, name: str, hook, first: bool = False) -> None:
    """Chain ``hook`` after the parameter's existing hooks (``first``: before them, for a new
    storage layout of the parameter itself)."""
    previous = layer.__dict__.get("_param_hooks", {}).get(name)
    layer.set_param_hook(name, _Chain(hook, previous) if first else _Chain(previous, hook))


def _restore(layer: nn.Module, name: str, storage: torch.Tensor, spec: ShardSpec, hook, first: bool = False) -> None:
    """Replace parameter ``name`` by ``storage`` (same values, another shape) with its spec,
    read by the layer through ``hook``."""
    layer._parameters[name] = nn.Parameter(storage.contiguous(), requires_grad=layer._parameters[name].requires_grad)
    set_shard_spec(layer, name, spec)
    _add_hook(layer, name, hook, first)


def as_conv1d_storage(layer: nn.Module) -> None:
    """Store ``layer.weight`` [out_l, in_l] (or a packed [K, w, in_l]) as a Conv1D does, input
    dim first: [in_l, out_l] ([in_l, K, w]); the spec follows."""
    spec = get_shard_spec(layer, "weight")
    w = layer._parameters["weight"]
    _restore(layer, "weight", w.detach().movedim(-1, 0), _input_first(spec), _input_last, first=True)


def _input_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(0, -1)


def _input_first(spec: ShardSpec) -> ShardSpec:
    """``spec`` with its last (input) dim moved to the front."""
    def move(shape):
        return (shape[-1], *shape[:-1]) if shape else shape

    serial = move(spec.serial_shape) if spec.serial_shape else None
    return ShardSpec(move(spec.global_shape), move(spec.offsets), move(spec.local_shape), spec.partitioned_over,
                     spec.replicated_over, serial)


# -- packed projections -----------------------------------------------------------------------
def regroup_rows(t: torch.Tensor, parts: int, blocks: int) -> torch.Tensor:
    """[parts * n, ...] in part order -> the same rows in block order [blocks, parts, n/blocks]."""
    rest = t.shape[1:]
    return t.reshape(parts, blocks, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def build_packed(module: nn.Module, parts: int, layout, make) -> nn.Module:
    """The column layer for a projection packing ``parts`` equal parts (module doc);
    ``make(serial nn.Linear)`` builds the column layer of ``layout``."""
    lin = serial_linear(module)
    blocks = layout.column_blocks()
    out = lin.out_features
    if out % (parts * blocks):
        raise ValueError(f"a packed projection of {out} features in {parts} parts cannot be cut into {blocks} blocks "
                         f"per part; use a tp that divides each part")
    weight = regroup_rows(lin.weight, parts, blocks)
    bias = None if lin.bias is None else regroup_rows(lin.bias, parts, blocks)
    layer = make(serial_linear(None, weight, bias))
    width = out // parts // blocks  # rows of one part in one block
    for name in ("weight", "bias"):
        spec = get_shard_spec(layer, name)
        if spec is not None:
            _pack(layer, name, spec, parts, width)
    per_rank = layer.out_features // parts // width // _hidden_parts(layer, layout)
    if per_rank > 1:  # the output holds several blocks: (block, part) -> (part, block)
        layer.register_forward_hook(lambda m, a, y: _parts_first(y, per_rank, parts))
    if is_conv1d(module):
        as_conv1d_storage(layer)
    return layer


def _hidden_parts(layer: nn.Module, layout) -> int:
    return layout.mesh.size(layout.after(layer).hidden_axis)


def _pack(layer: nn.Module, name: str, spec: ShardSpec, parts: int, width: int) -> None:
    """Store this rank's rows (``spec`` over the block-ordered tensor) as [parts, rows/parts, ...]
    of the serial tensor seen as [parts, n, ...]."""
    local = layer._parameters[name].detach()
    rows, rest = local.shape[0], tuple(local.shape[1:])
    first_block, held = spec.offsets[0] // (parts * width), rows // (parts * width)
    n = spec.global_shape[0] // parts
    storage = local.reshape(held, parts, width, *rest).transpose(0, 1).reshape(parts, held * width, *rest)
    packed = ShardSpec((parts, n, *spec.global_shape[1:]), (0, first_block * width, *spec.offsets[1:]),
                       (parts, held * width, *rest), spec.partitioned_over, spec.replicated_over,
                       serial_shape=spec.global_shape)

    def to_layer(t, held=held, width=width, parts=parts, rest=rest):
        return t.reshape(parts, held, width, *rest).transpose(0, 1).reshape(held * parts * width, *rest)

    _restore(layer, name, storage, packed, to_layer)


def _parts_first(y: torch.Tensor, blocks: int, parts: int) -> torch.Tensor:
    lead = y.shape[:-1]
    return y.reshape(*lead, blocks, parts, -1).transpose(-3, -2).reshape(*lead, -1)


# -- grouped-query attention: kv heads repeated ------------------------------------------------
def build_repeated_kv(name: str, module: nn.Module, layout, spec, make) -> nn.Module:
    """The column layer of a kv projection when the head parts exceed the kv heads: built from
    the serial weight with each kv head repeated, its pieces pointed at the serial rows, their
    gradients summed over the head axis (heads.py); ``make(serial nn.Linear)`` builds the layer."""
    rep = spec.parts // spec.kv_heads
    lin = serial_linear(module)
    bias = None if lin.bias is None else _repeat_heads(lin.bias, spec.head_dim, rep)
    layer = make(serial_linear(None, _repeat_heads(lin.weight, spec.head_dim, rep), bias))
    group = layout.mesh.group(spec.axis)
    for pname in ("weight", "bias"):
        piece = get_shard_spec(layer, pname)
        if piece is None:
            continue
        serial = _serial_piece(f"{name}.{pname}", piece, spec.head_dim, rep, spec.kv_heads)
        set_shard_spec(layer, pname, serial)
        slot, slots, first = replica_slot(serial.offsets, group)
        _add_hook(layer, pname, ReplicaGradSum(group, slot, slots))
        if not first:  # a later copy: norms and writers count the first one only
            mark_repeated_copy(layer, pname)
    if is_conv1d(module):
        as_conv1d_storage(layer)
    return layer


def _repeat_heads(t: torch.Tensor, head_dim: int, rep: int) -> torch.Tensor:
    """[kv * d, ...] -> [kv * rep * d, ...], each head's rows repeated ``rep`` times in a row."""
    heads = t.detach().reshape(-1, head_dim, *t.shape[1:])
    return heads.repeat_interleave(rep, 0).reshape(-1, *t.shape[1:]).clone()


def _serial_piece(who: str, piece: ShardSpec, head_dim: int, rep: int, kv_heads: int) -> ShardSpec:
    """``piece`` (rows of the repeated tensor) as the same rows of the serial kv tensor."""
    head, within = divmod(piece.offsets[0], head_dim)
    if within + piece.local_shape[0] > head_dim:
        raise ValueError(f"{who}: a rank's rows cross a kv head boundary (head_dim={head_dim}); use a tp whose head "
                         f"parts divide the heads evenly")
    offsets = ((head // rep) * head_dim + within, *piece.offsets[1:])
    return ShardSpec((kv_heads * head_dim, *piece.global_shape[1:]), offsets, piece.local_shape,
                     piece.partitioned_over, piece.replicated_over)
