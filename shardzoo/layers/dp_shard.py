"""The piece of a tensor that FSDP2 sharded over data-parallel mesh axes, as a ShardSpec.

``fully_shard`` over the dp (or flattened dp x sp) DeviceMesh replaces a parameter whose
local tensor is this rank's tensor-parallel piece (ShardSpec ``spec``) by a DTensor of that
piece's shape, sharded on dim 0 over the dp axes. The rows this rank keeps are again a
rectangle of the global tensor: :func:`rank_piece` returns them with a spec in global
coordinates whose ``partitioned_over`` gains the dp axes. Checkpoint save / load, gradient
norms and tied-gradient sums read pieces through it, so they need no FSDP2 special case.

Optimizer state of such a parameter (AdamW's ``exp_avg``) is a DTensor with the same
placements and gets the same piece; :func:`like_param` turns a loaded piece back into one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardzoo.comm.expert_mesh import EXPERT_AXES
from shardzoo.layers.shard_spec import ShardSpec, ShardSpecError


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of ``t``: the local tensor of a DTensor (a view, so in-place
    changes reach the DTensor), ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _parse_axes(name: str, axes: tuple[str, ...]) -> tuple[str, ...] | None:
    """Mesh axes joined by "_" in ``name`` (ParallelMesh.sub_mesh's flattened names), or None."""
    if name in axes:
        return (name,)
    for a in sorted(axes, key=len, reverse=True):
        if name.startswith(a + "_"):
            rest = _parse_axes(name[len(a) + 1:], axes)
            if rest is not None:
                return (a,) + rest
    return None


def mesh_axes(device_mesh, mesh) -> tuple[tuple[str, ...], ...]:
    """For each dim of ``device_mesh``, the ParallelMesh axes it spans (checked by ranks)."""
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ShardSpecError("a DTensor's DeviceMesh has no dim names, so its ranks cannot be matched to the "
                             "ParallelMesh axes; shard over mesh.sub_mesh('dp', ...) of the model's ParallelMesh")
    out = []
    for dim, name in enumerate(names):
        axes = _parse_axes(name, tuple(mesh.axis_names) + EXPERT_AXES)
        if axes is None or device_mesh.size(dim) != mesh.size(*axes) or \
                dist.get_process_group_ranks(device_mesh.get_group(dim)) != mesh.ranks(*axes):
            raise ShardSpecError(f"DeviceMesh dim {name!r} is not a group of the model's {mesh!r}; shard over "
                                 f"mesh.sub_mesh('dp', ...) of the mesh the model was built on")
        out.append(axes)
    return tuple(out)


def group_axes(group, mesh, experts: bool = False) -> tuple[str, ...]:
    """The ParallelMesh axes (among dp, sp; ``experts``: of tensors split over ep, edp) whose
    group is ``group``."""
    ranks = dist.get_process_group_ranks(group)
    for axes in ((("edp",),) if experts else (("dp",), ("sp",), ("dp", "sp"))):
        if mesh.ranks(*axes) == ranks:
            return axes
    which = "edp group (the experts' replicas)" if experts else "dp, sp or dp x sp group"
    raise ShardSpecError(f"process group of ranks {ranks} is not the {which} of {mesh!r}")


def rank_piece(t: torch.Tensor, spec: ShardSpec | None, mesh, who: str = "tensor"
               ) -> tuple[torch.Tensor, ShardSpec | None]:
    """(this rank's values of ``t``, their spec in global coordinates).

    A plain tensor is its own piece: ``(t, spec)``. A DTensor (FSDP2 sharded it over dp axes
    of ``mesh``) gives ``(t.to_local(), spec')``: the rows it keeps of the tp piece ``spec``
    (or of the whole tensor when ``spec`` is None), partitioned over the dp axes too.
    Raises :class:`ShardSpecError` naming ``who`` for placements other than Shard / Replicate."""
    if not isinstance(t, DTensor):
        return t, spec
    if mesh is None:
        raise ShardSpecError(f"{who} is a DTensor but no ParallelMesh is known for it; set module.mesh to the "
                             f"ParallelMesh its DeviceMesh came from")
    base = spec or ShardSpec(tuple(t.shape), (0,) * t.dim(), tuple(t.shape), (), ())
    if tuple(t.shape) != base.local_shape:
        raise ShardSpecError(f"{who} is a DTensor of shape {tuple(t.shape)} but its ShardSpec says "
                             f"{base.local_shape}; the parameter was replaced after the layer set its spec")
    parted = list(base.partitioned_over)
    for axes, placement in zip(mesh_axes(t.device_mesh, mesh), t.placements):
        if isinstance(placement, Shard) and type(placement) is Shard:
            parted.extend(axes)
        elif not isinstance(placement, Replicate):
            raise ShardSpecError(f"{who} is a DTensor placed {placement} on {axes}; only Shard(d) and Replicate "
                                 f"(FSDP2's fully_shard) are understood")
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):
        raise ShardSpecError(f"{who}: the DTensor's local shape {tuple(local.shape)} is not the {tuple(shape)} its "
                             f"placements {t.placements} give")
    composed = ShardSpec(base.global_shape, tuple(o + b for o, b in zip(offsets, base.offsets)), tuple(shape),
                         tuple(parted), base.replicated_over)
    return local, composed


def reshard_fsdp(model: torch.nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state (FSDP2's ``reshard()``).

    A forward without a backward (evaluation) leaves the modules that do not reshard after
    forward (all of zero=2, the root of zero=3) unsharded: their registered parameters are
    then whole plain tensors, not the DTensors the optimizer holds, and writes to them are
    lost at the next unshard. Saving, loading and gathering read or write the sharded ones,
    so they call this first; the next forward gathers the parameters again as usual. Local
    (no communication); a no-op for modules that are sharded already or not FSDP2's."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (a piece shaped like ``param``'s own) as ``param`` holds it: a DTensor with
    ``param``'s mesh and placements when ``param`` is one, ``local`` itself otherwise."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
