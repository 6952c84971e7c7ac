"""Activation placements of the tensor-parallel modes (how an activation tensor is split over the
mesh), and how to enter / leave them.

An activation ``x`` of global shape [B, ..., H] is held as one block per tp rank: dim 0 (batch)
is split over ``batch_axes`` (the first axis slowest), the last dim (hidden) over
``hidden_axis``; middle dims (sequence, ...) are whole, so sequence parallelism over "sp"
composes unchanged. Canonical placements per mode (docs/design.md, "One object per tp_mode"):

====== ============================== ============ ====================== ===================
mode   batch split over               hidden over  local block            replicated params
====== ============================== ============ ====================== ===================
1d     -                              tp           [B, ..., H/p]          -
2d     tp_row                         tp_col       [B/q, ..., H/q]        -
2.5d   tp_dep, tp_row                 tp_col       [B/(d*q), ..., H/q]    over tp_dep
3d     tp_x, tp_y                     tp_z         [B/q^2, ..., H/q]      -
====== ============================== ============ ====================== ===================

In 1D the placement says how a column layer's output (heads, the MLP's inner activation,
vocabulary-parallel logits) is split; between blocks 1D activations are replicated, and the
1D :class:`~shardzoo.layers.tensor_layout.TensorLayout` enters and leaves that replicated form.
In 3D a linear layer consuming placement (I, J | L) produces (I, L | J): the input and output roles
of the last two axes swap, so the second layer of an MLP takes ``fc1.output_placement``.
The placements fixed when the modules are built are the contract between them: a module checks
what a shape can tell (the local hidden size, the batch split), and a block of the right shape
in another placement cannot be told apart (docs/design.md, "Placements are fixed at construction").

Parameters of the layers follow the placement: a tensor indexed by the hidden size is split over
``hidden_axis`` and, where the layer says so, further over ``param_axes`` (the batch axes except
tp_dep; gathered in forward, so no rank stores a replica), and is replicated over
``replica_axes`` (tp_dep in 2.5D; its gradient is summed there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardzoo import comm
from shardzoo.comm.mesh import default_device
from shardzoo.comm.tp_grids import TP_GRIDS
from shardzoo.layers.module import ParallelModule
from shardzoo.layers.shard_spec import ShardSpec, shard_param

@dataclass(frozen=True)
class ActivationPlacement:
    """Where the batch (dim 0) and hidden (dim -1) of an activation are split.

    Attributes:
        mode: the mesh's tp_mode ("1d", "2d", "2.5d" or "3d").
        batch_axes: mesh axes splitting dim 0, slowest first (batch index = row-major).
        hidden_axis: mesh axis splitting the last dim.
    """

    mode: str
    batch_axes: tuple[str, ...]
    hidden_axis: str

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Axes over which parameters are replicated (their gradients summed): tp_dep in 2.5D."""
        depth_axis = TP_GRIDS[self.mode].depth_axis
        return (depth_axis,) if depth_axis else ()

    @property
    def param_axes(self) -> tuple[str, ...]:
        """Batch axes that further split hidden-indexed parameters (gathered in forward)."""
        return tuple(a for a in self.batch_axes if a not in self.replica_axes)

    def batch_parts(self, mesh) -> int:
        return mesh.size(*self.batch_axes) if self.batch_axes else 1

    def batch_index(self, mesh) -> int:
        """This rank's block index along the batch (row-major over ``batch_axes`` in order)."""
        idx = 0
        for a in self.batch_axes:
            idx = idx * mesh.size(a) + mesh.rank(a)
        return idx

    def __str__(self) -> str:
        batch = "*".join(self.batch_axes) or "none"
        return f"batch over {batch}, hidden over {self.hidden_axis}"


# Batch over every tp sub-axis but the fastest, hidden over the fastest (the table above)
_CANONICAL = {mode: ActivationPlacement(mode, grid.sub_axes[:-1], grid.sub_axes[-1])
              for mode, grid in TP_GRIDS.items()}


def canonical_placement(mesh) -> ActivationPlacement:
    """The placement a mode's first layer consumes (table in the module docstring)."""
    return canonical_for(getattr(mesh, "tp_mode", None))


def canonical_for(mode: str) -> ActivationPlacement:
    """:func:`canonical_placement` of a tp_mode, without a mesh (the planner prices layers it
    never builds)."""
    if mode not in _CANONICAL:
        raise ValueError(f"activation placements exist for tp_mode {', '.join(map(repr, _CANONICAL))}; got {mode!r}")
    return _CANONICAL[mode]


def swapped_3d(placement: ActivationPlacement) -> ActivationPlacement:
    """Output placement of a 3D linear layer that consumes ``placement``: (I, J | L) -> (I, L | J)."""
    (i_axis, j_axis), l_axis = placement.batch_axes, placement.hidden_axis
    return ActivationPlacement("3d", (i_axis, l_axis), j_axis)


def check_mesh(mesh, mode: str, who: str) -> None:
    """Raise unless ``mesh`` is a ParallelMesh of ``mode``."""
    if getattr(mesh, "tp_mode", None) != mode:
        got = getattr(mesh, "tp_mode", type(mesh).__name__)
        raise ValueError(f"{who} needs a ParallelMesh with tp_mode={mode!r}; got {got!r}")


def check_divisible(who: str, what: str, value: int, parts: int, rule: str) -> None:
    """Raise ``"<who> needs <what> divisible by <rule>; got <value>"`` unless ``parts | value``."""
    if value % parts != 0:
        raise ValueError(
            f"{who} needs {what} divisible by {rule}; got {value}. Choose {what} as a multiple of {parts}"
        )


def check_local_input(who: str, x: torch.Tensor, in_features: int, q: int) -> None:
    """Raise unless ``x`` is a local block [..., in_features/q] (not the full activation)."""
    if x.shape[-1] * q != in_features:
        raise ValueError(
            f"{who} expects the local input block [..., in_features/q={in_features // q}]; got shape "
            f"{tuple(x.shape)}. Enter the parallel region with layer.shard_input(x_full)"
        )


def _scatter_batch(x: torch.Tensor, mesh, placement: ActivationPlacement, who: str) -> torch.Tensor:
    parts = placement.batch_parts(mesh)
    rule = "*".join(f"{a}={mesh.size(a)}" for a in placement.batch_axes)
    if len(placement.batch_axes) > 1:
        rule = f"{rule} ({parts})"
    check_divisible(who, "the batch size (dim 0)", x.shape[0], parts, rule)
    for a in placement.batch_axes:  # slowest axis first, so the block index is row-major
        x = comm.scatter_to(x, mesh.group(a), 0)
    return x


def _gather_batch(y: torch.Tensor, mesh, placement: ActivationPlacement) -> torch.Tensor:
    for a in reversed(placement.batch_axes):
        y = comm.gather_from(y, mesh.group(a), 0)
    return y


def shard_activation(x_full: torch.Tensor, mesh, placement: ActivationPlacement | None = None,
                     who: str = "shard_activation") -> torch.Tensor:
    """This rank's block of a replicated activation: [B, ..., H] -> [B/batch_parts, ..., H/q].

    Differentiable: the gradient of ``x_full`` is the full gradient on every rank."""
    placement = placement or canonical_placement(mesh)
    q = mesh.size(placement.hidden_axis)
    check_divisible(who, "the hidden size (last dim)", x_full.shape[-1], q, f"q={q}")
    x = _scatter_batch(x_full, mesh, placement, who)
    return comm.scatter_to(x, mesh.group(placement.hidden_axis), -1)


def gather_activation(y_local: torch.Tensor, mesh, placement: ActivationPlacement | None = None) -> torch.Tensor:
    """The full activation from every rank's block: [B/batch_parts, ..., H/q] -> [B, ..., H]
    on every rank. Differentiable (each rank keeps its block of the gradient)."""
    placement = placement or canonical_placement(mesh)
    y = comm.gather_from(y_local, mesh.group(placement.hidden_axis), -1)
    return _gather_batch(y, mesh, placement)


def shard_batch(x_full: torch.Tensor, mesh, placement: ActivationPlacement | None = None,
                who: str = "shard_batch") -> torch.Tensor:
    """Split only dim 0 over the placement's batch axes (token ids, images, targets):
    [B, ...] -> [B/batch_parts, ...]. Differentiable for float inputs."""
    return _scatter_batch(x_full, mesh, placement or canonical_placement(mesh), who)


def gather_batch(y_local: torch.Tensor, mesh, placement: ActivationPlacement | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_batch`: [B/batch_parts, ...] -> [B, ...] on every rank."""
    return _gather_batch(y_local, mesh, placement or canonical_placement(mesh))


# -- parameters placed along the placement -----------------------------------------------------
def hidden_parts(mesh, placement: ActivationPlacement) -> int:
    """Pieces a hidden-indexed parameter is cut into: q * size(param_axes)."""
    sub = mesh.size(*placement.param_axes) if placement.param_axes else 1
    return mesh.size(placement.hidden_axis) * sub


def check_hidden_parts(who: str, what: str, value: int, mesh, placement: ActivationPlacement) -> None:
    """Raise unless ``value`` splits into :func:`hidden_parts` pieces (q*q in 2D / 2.5D, q^3 in 3D)."""
    parts = hidden_parts(mesh, placement)
    rule = "*".join("q" * TP_GRIDS[placement.mode].sides)  # the grid's sides: depth holds replicas
    check_divisible(who, what, value, parts, f"{rule}={parts}")


def hidden_param(module: nn.Module, name: str, full: torch.Tensor, dim: int, mesh, placement: ActivationPlacement,
                 device) -> nn.Parameter:
    """Register as ``module.<name>`` this rank's piece of ``full`` cut along ``dim`` into
    q * size(param_axes) chunks: chunk ``hidden_rank * size(param_axes) + param_rank``, so
    gathering over ``param_axes`` yields the hidden block of this rank. Replicated over
    ``replica_axes``; its ShardSpec recorded on ``module``."""
    parts = hidden_parts(mesh, placement)
    sub = mesh.size(*placement.param_axes) if placement.param_axes else 1
    sub_rank = mesh.rank(*placement.param_axes) if placement.param_axes else 0
    index = mesh.rank(placement.hidden_axis) * sub + sub_rank
    dim = dim % full.dim()
    spec = ShardSpec.split(tuple(full.shape), {dim: (index, parts)}, (placement.hidden_axis,) + placement.param_axes,
                           placement.replica_axes)
    return shard_param(module, name, full, spec, device if device is not None else default_device(mesh))


def gather_hidden_param(param: torch.Tensor, dim: int, mesh, placement: ActivationPlacement) -> torch.Tensor:
    """The hidden block of a :func:`hidden_param` for this rank: all-gather over ``param_axes``
    along ``dim`` (gradient reduce-scattered back), gradient summed over ``replica_axes``."""
    if placement.replica_axes:
        param = comm.copy_to(param, mesh.group(*placement.replica_axes))
    if placement.param_axes:
        param = comm.all_gather(param, mesh.group(*placement.param_axes), dim)
    return param


def block_param(module: nn.Module, name: str, full: torch.Tensor, dim: int, mesh, placement: ActivationPlacement,
                device) -> nn.Parameter:
    """Register as ``module.<name>`` this rank's hidden block of a small vector-like ``full``
    (LayerNorm weight, bias): split along ``dim`` over ``hidden_axis`` only, replicated over the
    batch axes (gradient summed there by :func:`use_block_param`); spec recorded on ``module``."""
    split = {dim % full.dim(): (mesh.rank(placement.hidden_axis), mesh.size(placement.hidden_axis))}
    spec = ShardSpec.split(tuple(full.shape), split, (placement.hidden_axis,), placement.batch_axes)
    return shard_param(module, name, full, spec, device if device is not None else default_device(mesh))


def use_block_param(param: torch.Tensor, mesh, placement: ActivationPlacement) -> torch.Tensor:
    """A :func:`block_param` as used in forward: identity, gradient summed over the batch axes."""
    return comm.copy_to(param, mesh.group(*placement.batch_axes)) if placement.batch_axes else param


class GridModule(ParallelModule):
    """Base of the 2D / 2.5D / 3D modules: ``mesh``, ``placement`` (the input activation placement),
    ``output_placement``, and ``shard_input`` / ``gather_output`` for them."""

    mode = "2d"
    any_placement = True  # False: the module works in the canonical placement only (the SUMMA modules)

    def _bind(self, mesh, placement: ActivationPlacement | None) -> None:
        check_mesh(mesh, self.mode, type(self).__name__)
        placement = placement or canonical_placement(mesh)
        who = type(self).__name__
        if placement.mode != mesh.tp_mode:
            raise ValueError(
                f"{who} got a placement for tp_mode={placement.mode!r} on a tp_mode={mesh.tp_mode!r} mesh; "
                f"a placement must belong to the module's mesh mode. Pass the output_placement of a module on the "
                f"same mesh, canonical_placement(mesh), or no placement (the canonical one)")
        if not self.any_placement and placement != canonical_placement(mesh):
            raise ValueError(f"{who} works in the canonical placement ({canonical_placement(mesh)}) only; got "
                             f"placement ({placement}). Build it with no placement= argument, on blocks in the "
                             f"canonical placement")
        self.mesh, self.placement = mesh, placement

    @property
    def output_placement(self) -> ActivationPlacement:
        return self.placement

    def _check_input(self, x: torch.Tensor, features: int) -> None:
        """Refuse ``x`` unless it is a local block [..., features / hidden parts]. Only the shape
        can be checked: a block of the same shape in another placement (2D transposed, 3D swapped)
        is not detectable, so the placements fixed at construction are the contract (docs/design.md,
        "Placements are fixed at construction")."""
        check_local_input(type(self).__name__, x, features, self.mesh.size(self.placement.hidden_axis))

    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """[B, ..., H] (replicated) -> this rank's block in ``self.placement``."""
        return shard_activation(x_full, self.mesh, self.placement, type(self).__name__)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """This rank's block in ``self.output_placement`` -> [B, ..., H] on every rank."""
        return gather_activation(y_local, self.mesh, self.output_placement)
