"""``full_state_dict``: the serial-named, full-size state dict of any parallel module.

It sits above shard_spec.py, dp_shard.py and replicas.py, which it combines (the specs, FSDP2's
resharding and the replica check), so none of them imports it back.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers import replicas
from shardzoo.layers.dp_shard import reshard_fsdp
from shardzoo.layers.shard_spec import ShardSpecError, check_specs, gather_full, get_shard_spec, local_piece, unwrap_ddp


def full_state_dict(module: nn.Module, *, check_replicas: bool = False) -> dict[str, torch.Tensor]:
    """Serial-named, full-size state dict of any (parallel) module, on every rank.

    Collective: every rank of each sharded parameter's group must call it. Parameters and
    buffers without a ShardSpec are returned as they are (replicated). Sharded tensors are
    found through ``module.mesh`` of the module that owns them. Parameters FSDP2's
    ``fully_shard`` turned into DTensors are gathered over their dp mesh first, then over the
    tensor-parallel axes of their spec. Raises :class:`ShardSpecError` naming the tensor when
    a piece does not match its spec, or a sharded module's parameter has none. A DDP
    wrapper is looked through (serial names, no ``module.`` prefix); FSDP2 modules that a
    forward without backward left unsharded are resharded first. ``check_replicas=True``
    first compares the copies of every replicated parameter across the ranks holding them and
    raises :class:`~shardzoo.layers.replicas.ReplicaMismatchError` naming those that differ
    (one checksum pass and one int64 all-reduce; layers/replicas.py)."""
    module = unwrap_ddp(module)
    reshard_fsdp(module)
    if check_replicas:
        replicas.check_replicas(module, what="full_state_dict")
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in module.named_modules():
        mesh = getattr(mod, "mesh", None)
        check_specs(mod, mod_name or type(mod).__name__)
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if name in getattr(mod, "_non_persistent_buffers_set", ()):
                continue
            key = f"{mod_name}.{name}" if mod_name else name
            spec = get_shard_spec(mod, name)
            if spec is not None and spec.partitioned_over and mesh is None:
                raise ShardSpecError(f"{key} has a ShardSpec but its module {type(mod).__name__} has no .mesh; set "
                                     f"module.mesh to the ParallelMesh the spec's axes refer to")
            full = gather_full(local_piece(key, t, spec), spec, mesh)
            out[key] = full.reshape(spec.serial_shape) if spec is not None and spec.serial_shape else full
    return out
