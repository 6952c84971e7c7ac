"""Pieces shared by the 1D (Megatron) layers: specs, divisibility checks, sequence placement.

Activations are ``[batch, seq, hidden]``. With sequence parallelism the activations *outside*
the tensor-parallel region (norms, dropout, residual adds) are split along the sequence dim,
``SEQ_DIM = 1``, over the tp group; a column layer all-gathers them on entry and a row layer
reduce-scatters its output back to that placement.
"""

from __future__ import annotations

import torch

from shardzoo.comm import collectives as comm
from shardzoo.layers.shard_spec import ShardSpec, shard_param

SEQ_DIM = 1


def split_spec(global_shape, dim: int, mesh) -> ShardSpec:
    """Spec of this tp rank's piece of ``global_shape`` split along ``dim`` (padded if uneven)."""
    return ShardSpec.split(tuple(global_shape), {dim: (mesh.tp_rank, mesh.tp_size)}, partitioned_over=("tp",))


def replicated_spec(global_shape) -> ShardSpec:
    """Spec of a tensor every tp rank holds whole."""
    shape = tuple(int(s) for s in global_shape)
    return ShardSpec(shape, (0,) * len(shape), shape, partitioned_over=(), replicated_over=("tp",))


def local_param(module: torch.nn.Module, name: str, full: torch.Tensor | None, spec: ShardSpec,
                device=None) -> torch.nn.Parameter | None:
    """Register ``spec.take(full)`` on ``device`` as ``module.<name>`` with ``spec`` (a None
    ``full`` registers None); returns the Parameter."""
    if full is None:
        module.register_parameter(name, None)
        return None
    return shard_param(module, name, full, spec, device)


def require_divisible(layer: str, what: str, value: int, tp: int) -> None:
    """Raise a message naming the value, the rule and the fix unless ``tp`` divides ``value``."""
    if value % tp != 0:
        up = -(-value // tp) * tp
        raise ValueError(
            f"{layer} needs {what} divisible by tp={tp}; got {what}={value}. Use a multiple of {tp} "
            f"(e.g. {up}) or a tp size that divides {value}"
        )


def require_sequence_placement(layer: str, x: torch.Tensor) -> None:
    """Sequence-parallel inputs are [batch, seq, hidden] with seq split over tp."""
    if x.dim() != 3:
        raise ValueError(
            f"{layer}(sequence_parallel=True) takes [batch, seq, hidden] activations; got shape "
            f"{tuple(x.shape)}. Reshape to 3 dims or turn sequence_parallel off"
        )


def enter_sequence_parallel(x_full: torch.Tensor, mesh) -> torch.Tensor:
    """[b, s, h] replicated -> [b, s/tp, h] this rank's sequence chunk (differentiable)."""
    return comm.scatter_to(x_full, mesh.tp_group, SEQ_DIM)


def leave_sequence_parallel(x_local: torch.Tensor, mesh) -> torch.Tensor:
    """[b, s/tp, h] sequence chunks -> [b, s, h] replicated (differentiable)."""
    return comm.gather_from(x_local, mesh.tp_group, SEQ_DIM)


def tp_sum_grad(param: torch.Tensor, mesh, sequence_parallel: bool) -> torch.Tensor:
    """``param`` as used in forward: under sequence parallelism each tp rank sees only its own
    tokens, so the parameter's gradient is a partial sum and ``copy_to`` all-reduces it in
    backward; otherwise every rank computes the full gradient already."""
    return comm.copy_to(param, mesh.tp_group) if sequence_parallel else param
