"""LayerNorm / RMSNorm for 1D tensor parallelism, with an optional sequence-parallel placement.

Parameters are replicated on every tp rank (ShardSpec ``replicated_over=("tp",)``). Without
sequence parallelism every rank normalises the same full activation and computes the full
parameter gradient itself. With ``sequence_parallel=True`` the input is this rank's sequence
chunk ``[b, s/p, h]``, so each rank's parameter gradient covers only its tokens: forward uses
the parameters through ``comm.copy_to`` (identity), whose backward all-reduces the gradient
over tp, so after ``backward()`` every rank holds the full, identical gradient (what
Megatron's separate "all-reduce sequence-parallel grads" step does, kept inside autograd).

:class:`ColumnLayerNorm1D` / :class:`ColumnRMSNorm1D` normalise a column layer's output over
its whole width, which is split over tp (a norm over all heads, OLMoE's q / k norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.layers.common_1d import (
    enter_sequence_parallel,
    leave_sequence_parallel,
    local_param,
    replicated_spec,
    require_sequence_placement,
    tp_sum_grad,
)
from shardzoo.layers.module import ParallelModule
from shardzoo.layers.norm_2d import GridLayerNorm, GridRMSNorm


def _shape(normalized_shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class _Norm1D(ParallelModule):
    """Shared plumbing: replicated params, sequence-parallel gradient sum, placement helpers."""

    def _setup(self, serial: nn.Module, mesh, device, sequence_parallel: bool = False) -> None:
        self.normalized_shape, self.eps = tuple(serial.normalized_shape), serial.eps
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        if device is None and getattr(serial, "weight", None) is not None:
            device = serial.weight.device
        for name in ("weight", "bias"):
            p = getattr(serial, name, None)
            local_param(self, name, p, None if p is None else replicated_spec(p.shape), device)

    partial_grads = None  # between a model's sequence-sharded blocks: its PartialGrads (partial_grads.py)

    def _params(self):
        sp, grads = self.sequence_parallel, self.partial_grads
        out = []
        for name in ("weight", "bias"):
            p = getattr(self, name, None)
            if p is not None:
                p = grads.summed(self, name, p) if sp and grads is not None else tp_sum_grad(p, self.mesh, sp)
            out.append(p)
        return tuple(out)

    def _check(self, x: torch.Tensor) -> None:
        if self.sequence_parallel:
            require_sequence_placement(type(self).__name__, x)

    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` -> ``[b, s/p, h]`` under sequence parallelism; identity otherwise."""
        return enter_sequence_parallel(x_full, self.mesh) if self.sequence_parallel else x_full

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """``[b, s/p, h]`` -> ``[b, s, h]`` under sequence parallelism; identity otherwise."""
        return leave_sequence_parallel(y_local, self.mesh) if self.sequence_parallel else y_local


class LayerNorm1D(_Norm1D):
    """``nn.LayerNorm`` with replicated parameters.

    Args: as ``nn.LayerNorm`` plus ``mesh`` and ``sequence_parallel`` (input ``[b, s/p, h]``).
    Shapes: ``[..., *normalized_shape]`` -> same.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        mesh,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        serial = nn.LayerNorm(_shape(normalized_shape), eps, elementwise_affine, bias, dtype=dtype)
        self._setup(serial, mesh, device, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        w, b = self._params()
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class RMSNorm1D(_Norm1D):
    """``nn.RMSNorm`` with replicated parameters.

    Args: as ``nn.RMSNorm`` plus ``mesh`` and ``sequence_parallel`` (input ``[b, s/p, h]``).
    Shapes: ``[..., *normalized_shape]`` -> same.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        mesh,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        serial = nn.RMSNorm(_shape(normalized_shape), eps, elementwise_affine, dtype=dtype)
        self._setup(serial, mesh, device, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        w, _ = self._params()
        return F.rms_norm(x, self.normalized_shape, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class ColumnLayerNorm1D(GridLayerNorm):
    """LayerNorm over the whole width W of a 1D column layer's output, which is split over tp
    (a norm over every head of a projection): x [..., W/p] -> same, the mean and variance
    all-reduced over tp (norm_2d.py); weight / bias this rank's block [W/p] of the columns its
    input holds, so their gradients are whole on each rank."""

    mode = "1d"


class ColumnRMSNorm1D(GridRMSNorm):
    """RMSNorm over the whole width W of a 1D column layer's output, which is split over tp
    (OLMoE's q_norm / k_norm over every head): x [..., W/p] -> same, the mean of squares
    all-reduced over tp (norm_2d.py); weight this rank's block [W/p] of the columns its input
    holds, so its gradient is whole on each rank."""

    mode = "1d"
