"""ShardSpec: which slice of a global (serial) tensor a rank's parameter holds.

Every sharded parameter carries ``param.shard_spec``. Checkpoint save, reshard-load, Hugging
Face loading and ``full_state_dict`` all derive from it; nothing parses parameter names to
find out how a tensor is split. A parameter without a spec is replicated on every rank.

A spec describes one rectangle: ``offsets`` and ``local_shape`` in the coordinates of the
global tensor of shape ``global_shape``. The rectangle may run past the end of the global
tensor (vocabulary padding); those rows are padding, invisible to users and checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardzoo.comm import ops


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in its global tensor.

    Attributes:
        global_shape: shape of the serial tensor (no padding).
        offsets: index of the local tensor's first element in each global dim.
        local_shape: shape of the local tensor (may include padding past the global end).
        partitioned_over: mesh axes across which the pieces differ (e.g. ("tp",)).
        replicated_over: mesh axes across which this exact piece is repeated (e.g. ("tp_dep",)).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    partitioned_over: tuple[str, ...] = ("tp",)
    replicated_over: tuple[str, ...] = ()

    @staticmethod
    def split(
        global_shape: tuple[int, ...],
        splits: dict[int, tuple[int, int]],
        partitioned_over: tuple[str, ...] = ("tp",),
        replicated_over: tuple[str, ...] = (),
    ) -> "ShardSpec":
        """Spec for an even split: ``splits[dim] = (index, parts)``; a dim whose size does not
        divide by ``parts`` is padded up to the next multiple (only the last pieces hold padding)."""
        global_shape = tuple(int(s) for s in global_shape)
        offsets, local = [0] * len(global_shape), list(global_shape)
        for dim, (index, parts) in splits.items():
            if not 0 <= index < parts:
                raise ValueError(f"shard index {index} is outside 0..{parts - 1}")
            local[dim] = math.ceil(global_shape[dim] / parts)
            offsets[dim] = index * local[dim]
        return ShardSpec(global_shape, tuple(offsets), tuple(local), tuple(partitioned_over), tuple(replicated_over))

    def valid_local(self) -> tuple[slice, ...]:
        """Slices of the local tensor that hold real (non-padding) values."""
        return tuple(slice(0, max(0, min(l, g - o))) for o, l, g in zip(self.offsets, self.local_shape, self.global_shape))

    def valid_global(self) -> tuple[slice, ...]:
        """Slices of the global tensor that this rank's real values cover."""
        return tuple(slice(min(o, g), min(o + l, g)) for o, l, g in zip(self.offsets, self.local_shape, self.global_shape))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from ``full`` (global shape), zero-padded."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"expected a tensor of global shape {self.global_shape}, got {tuple(full.shape)}")
        local = full.new_zeros(self.local_shape)
        local[self.valid_local()] = full[self.valid_global()]
        return local


def set_shard_spec(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Attach ``spec`` to ``param`` after checking it fits; returns ``param``."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(f"parameter of shape {tuple(param.shape)} does not match its spec's local shape {spec.local_shape}")
    param.shard_spec = spec
    return param


def get_shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The parameter's ShardSpec, or None when it is replicated everywhere."""
    return getattr(param, "shard_spec", None)


def gather_full(local: torch.Tensor, spec: ShardSpec | None, mesh) -> torch.Tensor:
    """The global tensor assembled from every rank's piece (collective over the spec's axes).

    ``local``: this rank's tensor of shape ``spec.local_shape``. Returns ``spec.global_shape``
    on every rank, padding dropped."""
    local = local.detach()
    if spec is None:
        return local.clone()
    group = mesh.group(*spec.partitioned_over) if spec.partitioned_over else None
    pieces = ops.all_gather(local.contiguous().unsqueeze(0), group, 0) if group is not None else local[None]
    offsets = torch.tensor(spec.offsets, dtype=torch.int64)
    all_offsets = ops.all_gather(offsets.unsqueeze(0), group, 0) if group is not None else offsets[None]
    full = local.new_zeros(spec.global_shape)
    for piece, offs in zip(pieces, all_offsets.tolist()):
        s = ShardSpec(spec.global_shape, tuple(offs), spec.local_shape)
        full[s.valid_global()] = piece[s.valid_local()]
    return full


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Serial-named, full-size state dict of any (parallel) module, on every rank.

    Collective: every rank of each sharded parameter's group must call it. Parameters and
    buffers without a ShardSpec are returned as they are (replicated). Sharded tensors are
    found through ``module.mesh`` of the module that owns them."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in module.named_modules():
        mesh = getattr(mod, "mesh", None)
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if name in getattr(mod, "_non_persistent_buffers_set", ()):
                continue
            key = f"{mod_name}.{name}" if mod_name else name
            spec = get_shard_spec(t)
            if spec is not None and mesh is None:
                raise ValueError(f"{key} has a ShardSpec but its module {type(mod).__name__} has no .mesh")
            out[key] = gather_full(t, spec, mesh)
    return out


def is_sharded(module: nn.Module) -> bool:
    """True when any parameter of ``module`` carries a ShardSpec."""
    return any(get_shard_spec(p) is not None for p in module.parameters())
