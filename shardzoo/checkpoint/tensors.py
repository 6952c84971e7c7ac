"""What a rank holds: its tensors with their global names and ShardSpecs, and the writer rule.

A ``LocalTensor`` is one parameter, persistent buffer or optimizer-state tensor on this rank.
Its *valid box* is the rectangle of the global tensor its real values cover (``offsets``,
``shape`` in global coordinates, vocabulary padding dropped); that box is what a checkpoint
stores as one piece, and what a load fills from whichever saved pieces overlap it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.comm.expert_mesh import EXPERT_AXES
from shardzoo.layers.dp_shard import rank_piece, reshard_fsdp
from shardzoo.layers.replicas import find_mesh
from shardzoo.layers.shard_spec import (ShardSpec, ShardSpecError, check_local, check_specs, get_shard_spec, tied_copies,
                                         unwrap_ddp)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in global coordinates


@dataclass
class LocalTensor:
    """One tensor on this rank.

    Attributes:
        name: global (serial) name, e.g. ``"blocks.0.fc1.weight"``; optimizer state is
            ``"<param name>/<state key>"``.
        tensor: the local data, shape ``spec.local_shape`` (or the global shape without a spec).
        spec: where it sits in the global tensor; None when every rank holding it has all of it.
        mesh: the ParallelMesh the spec's axes refer to (the owning module's, else the model's).
        held_over: mesh axes along which only one rank holds the tensor at all (optimizer state
            that ZeroRedundancyOptimizer partitions by parameter); the writer rule ignores them.
    """

    name: str
    tensor: torch.Tensor
    spec: ShardSpec | None
    mesh: object | None
    held_over: tuple[str, ...] = ()

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.spec.global_shape if self.spec is not None else tuple(self.tensor.shape)

    def valid_box(self) -> Box:
        """(offsets, shape) of the global region this rank's real values cover."""
        if self.spec is None:
            shape = tuple(self.tensor.shape)
            return (0,) * len(shape), shape
        region = self.spec.valid_global()
        return tuple(s.start for s in region), tuple(s.stop - s.start for s in region)

    def valid_data(self) -> torch.Tensor:
        """The local values inside :meth:`valid_box` (padding rows dropped)."""
        return self.tensor if self.spec is None else self.tensor[self.spec.valid_local()]


@torch.no_grad()
def fill_local(lt: LocalTensor, read) -> None:
    """Overwrite ``lt.tensor`` in place: ``read(box, out)`` writes the values of the valid box
    into ``out`` (the matching view of the local tensor); padding past the global end is zero."""
    box = lt.valid_box()
    region = lt.spec.valid_local() if lt.spec is not None else ...
    if lt.spec is not None and tuple(s.stop for s in region) != tuple(lt.tensor.shape):
        lt.tensor.zero_()  # this rank holds padding rows
    if volume(box[1]) > 0:
        read(box, lt.tensor[region])


def model_tensors(model: nn.Module) -> tuple[list[LocalTensor], dict[str, str]]:
    """Parameters and persistent buffers of ``model`` on this rank, and the tied aliases.

    A tensor reachable under several names (tied embeddings) is listed once, under the name
    ``named_parameters`` gives it; ``aliases`` maps each other name to that one. A parameter
    FSDP2 sharded over dp (a DTensor) is listed as the rows this rank keeps
    (layers/dp_shard.py), so every dp rank saves and loads its own part; FSDP2 modules left
    unsharded by a forward without backward are resharded first. A DDP wrapper is looked
    through."""
    model = unwrap_ddp(model)
    reshard_fsdp(model)
    model_mesh = find_mesh(model)
    copies = tied_copies(model)
    seen: dict[int, str] = {}
    tensors: list[LocalTensor] = []
    aliases: dict[str, str] = {}
    for mod_name, mod in model.named_modules():
        mesh = getattr(mod, "mesh", None)
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        members = list(mod._parameters.items()) + [(n, b) for n, b in mod._buffers.items() if n not in skip]
        for name, t in members:
            if t is None:
                continue
            key = f"{mod_name}.{name}" if mod_name else name
            key = copies.get(key, key)  # an untied copy of a tied table is the table's piece
            if id(t) in seen:
                aliases[key] = seen[id(t)]
                continue
            seen[id(t)] = key
            spec = get_shard_spec(mod, name)
            _check_saveable(key, mod, t, spec)
            if spec is not None and mesh is None:
                raise CheckpointError(f"{key} has a ShardSpec but its module {type(mod).__name__} has no .mesh; "
                                      f"set module.mesh to the ParallelMesh the spec's axes refer to")
            mesh_of = mesh if spec is not None else model_mesh
            try:
                local, spec = rank_piece(t.detach(), spec, mesh_of, key)
            except ShardSpecError as e:
                raise CheckpointError(str(e)) from e
            tensors.append(LocalTensor(key, local, spec, mesh_of))
    return tensors, aliases


def _check_saveable(key: str, module: nn.Module, t: torch.Tensor, spec: ShardSpec | None) -> None:
    """Refuse a tensor whose bytes are not this rank's piece of its spec: a piece of another
    shape than its spec, or a sharded module's parameter that lost its spec. A DTensor
    (FSDP2) is checked by its shape, which is the tp piece's."""
    try:
        check_specs(module, key.rpartition(".")[0] or type(module).__name__)
        if not isinstance(t, DTensor):
            check_local(key, t, spec)
    except ShardSpecError as e:
        raise CheckpointError(str(e)) from e


def _expand_axes(axes: tuple[str, ...], mesh) -> set[str]:
    """Mesh axis names with "tp" expanded into the mode's sub-axes."""
    out: set[str] = set()
    for a in axes:
        out.update(mesh.tp_sub_axes if a == "tp" else (a,))
    return out


def is_candidate_writer(lt: LocalTensor, rank: int) -> bool:
    """The writer rule: coordinate 0 on every mesh axis except pp and the spec's partitioned_over
    axes (pipeline stages own different tensors; replicas along every other axis are equal);
    for a tensor split over ep, the expert axes ep / edp replace dp / sp (comm/expert_mesh.py).
    Without a mesh, global rank 0. Equal pieces offered by several ranks (tied weights on two
    stages, a scalar optimizer step) are then written once, by the lowest rank."""
    if lt.mesh is None:
        return rank == 0
    free = _expand_axes(lt.spec.partitioned_over, lt.mesh) if lt.spec is not None else set()
    free |= _expand_axes(lt.held_over, lt.mesh)
    coordinate = lt.mesh.coordinate
    if free & set(EXPERT_AXES):  # split over ep: the expert axes (ep, edp) stand where dp and sp do
        coordinate = {a: c for a, c in coordinate.items() if a not in ("dp", "sp")}
        coordinate.update({a: lt.mesh.rank(a) for a in EXPERT_AXES})
    return all(c == 0 for axis, c in coordinate.items() if axis != "pp" and axis not in free)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when it is empty."""
    offsets, shape = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def relative_slices(inner: Box, outer_offsets: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices selecting box ``inner`` inside a tensor whose first element is at ``outer_offsets``."""
    return tuple(slice(o - oo, o - oo + s) for o, s, oo in zip(inner[0], inner[1], outer_offsets))


def volume(shape) -> int:
    return math.prod(int(s) for s in shape)
