"""ShardSpec: which slice of a global (serial) tensor a rank's parameter holds.

The spec of a sharded parameter lives on the module that owns it, keyed by the parameter's
name (``set_shard_spec(module, "weight", spec)`` / ``get_shard_spec(module, "weight")``), not
on the Parameter object: FSDP2's ``fully_shard``, DDP, ``torch.compile``, pipelining and
meta-device materialisation replace Parameter objects freely, and a spec stored on the object
would silently vanish with it. Checkpoint save, reshard-load, Hugging Face loading, gradient
norms and ``full_state_dict`` all read specs through :func:`get_shard_spec`; nothing parses
parameter names to find out how a tensor is split. A parameter without a spec is replicated
on every rank.

A spec describes one rectangle: ``offsets`` and ``local_shape`` in the coordinates of the
global tensor of shape ``global_shape``. The rectangle may run past the end of the global
tensor (vocabulary padding); those rows are padding, invisible to users and checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardzoo.comm import ops

_SPECS = "_shard_specs"  # module attribute: {parameter or buffer name: ShardSpec}


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in its global tensor.

    Attributes:
        global_shape: shape of the serial tensor (no padding).
        offsets: index of the local tensor's first element in each global dim.
        local_shape: shape of the local tensor (may include padding past the global end).
        partitioned_over: mesh axes across which the pieces differ (e.g. ("tp",)).
        replicated_over: mesh axes across which this exact piece is repeated (e.g. ("tp_dep",)).
        serial_shape: the serial tensor's shape when it is ``global_shape`` reshaped (a packed
            q|k|v projection held as [3, n, in] so each rank's piece is one rectangle); None
            when they are the same. ``full_state_dict`` gives this shape.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    partitioned_over: tuple[str, ...] = ("tp",)
    replicated_over: tuple[str, ...] = ()
    serial_shape: tuple[int, ...] | None = None

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


class ShardSpecError(ValueError):
    """A tensor does not fit its ShardSpec, or a spec that must be there is missing."""


def set_shard_spec(module: nn.Module, name: str, spec: ShardSpec | None) -> None:
    """Record that ``module``'s parameter (or buffer) ``name`` holds the piece ``spec`` of its
    global tensor (None: replicated, the record is removed). The tensor must be registered
    first and have shape ``spec.local_shape``."""
    t = module._parameters.get(name, module._buffers.get(name))
    who = f"{type(module).__name__}.{name}"
    if t is None:
        raise ShardSpecError(f"{who}: no parameter or buffer of that name to attach a ShardSpec to; register the "
                             f"tensor on the module before its spec")
    specs = module.__dict__.setdefault(_SPECS, {})
    if spec is None:
        specs.pop(name, None)
        return
    check_local(who, t, spec)
    specs[name] = spec


_COPIES = "_repeated_copies"  # module attribute: names of tensors whose piece a lower rank of the axis also holds


def mark_repeated_copy(module: nn.Module, name: str) -> None:
    """Record that ``module``'s tensor ``name`` is a later copy of a piece another rank along a
    partitioned axis holds too (kv heads repeated for grouped-query attention): whatever counts
    each piece once (the global gradient norm) skips it."""
    module.__dict__.setdefault(_COPIES, set()).add(name)


def is_repeated_copy(module: nn.Module, name: str) -> bool:
    """Whether tensor ``name`` (a dotted path is looked up on its owner) is such a later copy."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return leaf in owner.__dict__.get(_COPIES, ())


_TIED_COPIES = "_shardzoo_tied_copies"  # model attribute: {untied copy's name: its table's name}


def set_tied_copies(model: nn.Module, copies: dict[str, str]) -> None:
    """Record that ``model`` holds its own copy of a tied table under another name (a last
    pipeline stage's head without the first stage's token table): checkpoints list the copy under
    the table's name, so it is written once and read back from the table."""
    model.__dict__[_TIED_COPIES] = dict(copies)


def tied_copies(model: nn.Module) -> dict[str, str]:
    """``{copy name: table name}`` recorded by :func:`set_tied_copies` ({} when none)."""
    return model.__dict__.get(_TIED_COPIES, {})


def get_shard_spec(module: nn.Module, name: str) -> ShardSpec | None:
    """The ShardSpec of ``module``'s tensor ``name`` (a dotted path such as
    ``"blocks.0.fc1.weight"`` is looked up on the owning submodule), or None when replicated."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return owner.__dict__.get(_SPECS, {}).get(leaf)


def shard_param(module: nn.Module, name: str, full: torch.Tensor, spec: ShardSpec, device=None) -> nn.Parameter:
    """Register ``spec.take(full)`` (this rank's piece, on ``device``; default ``full``'s) as
    parameter ``name`` of ``module`` with its spec; returns the Parameter."""
    local = spec.take(full.detach())
    param = nn.Parameter(local.to(device) if device is not None else local)
    module.register_parameter(name, param)
    set_shard_spec(module, name, spec)
    return param


def tie_param(module: nn.Module, name: str, owner: nn.Module, owner_name: str = "weight") -> nn.Parameter:
    """Make ``module.<name>`` the very Parameter ``owner.<owner_name>`` (weight tying), with the
    owner's spec; returns it."""
    param = owner._parameters[owner_name]
    module.register_parameter(name, param)
    set_shard_spec(module, name, get_shard_spec(owner, owner_name))
    return param


def check_local(who: str, t: torch.Tensor, spec: ShardSpec | None) -> None:
    """Raise unless ``t`` (a plain tensor: this rank's piece) has its spec's local shape."""
    if spec is not None and tuple(t.shape) != spec.local_shape:
        raise ShardSpecError(
            f"{who} has local shape {tuple(t.shape)} but its ShardSpec says {spec.local_shape} (global "
            f"{spec.global_shape}); the tensor was replaced by one of another shape after the layer set its spec. "
            f"Rebuild the layer, or record the new piece with set_shard_spec(module, name, spec)")


def local_piece(who: str, t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's piece of a tensor, checked against ``spec`` (collective for a DTensor).

    A DTensor (a parameter FSDP2's ``fully_shard`` sharded over dp, or its gradient) is first
    gathered over its own device mesh (``full_tensor``), which gives back the piece the layer
    placed on this rank; a plain tensor is that piece already."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    check_local(who, t, spec)
    return t


def named_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """Every ShardSpec recorded in ``module`` and its submodules, by full tensor name."""
    out: dict[str, ShardSpec] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, spec in mod.__dict__.get(_SPECS, {}).items():
            out[f"{mod_name}.{name}" if mod_name else name] = spec
    return out


def check_specs(module: nn.Module, who: str | None = None) -> None:
    """Raise :class:`ShardSpecError` where ``module``'s own specs and tensors disagree: a spec
    whose tensor is gone, or a parameter without a spec on a module that records specs (a
    sharded layer states the placement of every parameter it owns, so a missing one would be
    read as replicated and come back in a wrong shape)."""
    who = who or type(module).__name__
    specs = module.__dict__.get(_SPECS)
    if not specs:
        return
    present = set(module._parameters) | set(module._buffers)
    for name in specs:
        if name not in present or (module._parameters.get(name, module._buffers.get(name)) is None):
            raise ShardSpecError(f"{who}.{name} has a ShardSpec but the module holds no such tensor any more; "
                                 f"drop it with set_shard_spec(module, {name!r}, None)")
    for name, p in module._parameters.items():
        if p is not None and name not in specs:
            raise ShardSpecError(f"{who}.{name} has no ShardSpec, though {type(module).__name__} records one for "
                                 f"its other parameters; a replaced parameter lost its placement. Record it with "
                                 f"set_shard_spec(module, {name!r}, spec)")


def gather_full(local: torch.Tensor, spec: ShardSpec | None, mesh) -> torch.Tensor:
    """The global tensor assembled from every rank's piece (collective over the spec's axes).

    ``local``: this rank's tensor of shape ``spec.local_shape``. Returns ``spec.global_shape``
    on every rank, padding dropped. A DTensor ``local`` (FSDP2) is first gathered over its
    own mesh (:func:`local_piece`)."""
    local = local_piece("gather_full", local, spec)
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


def unwrap_ddp(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (whose parameter names carry a ``module.`` prefix),
    else ``module``: names and specs are always the model's own."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def is_sharded(module: nn.Module) -> bool:
    """True when any parameter of ``module`` has a ShardSpec."""
    return bool(named_specs(module))
