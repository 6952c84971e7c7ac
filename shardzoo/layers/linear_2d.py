"""ParallelLinear2D (Optimus / SUMMA): y = x W^T + b on a q x q grid, tp = q*q.

Rank (i, j) holds the activation block x[batch block i, in block j] and the weight block
W[out block j, in block i] (nn.Linear's [out, in] layout; block (i, j) of A = W^T). The forward
is one SUMMA product (q broadcasts of x blocks along rows and of weight blocks along columns);
the backward two more (see summa_2d.py). The bias block b[out block j] is replicated over the
rows (and depth in 2.5D); its gradient is summed there.

The 2.5D layer (linear_2p5d.py) is this class on a depth-d mesh: each depth slice runs the
same SUMMA on its own batch blocks and the weight gradient is summed over depth.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo import comm
from shardzoo.comm.mesh import default_device
from shardzoo.layers import placements
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.shard_spec import ShardSpec, shard_param
from shardzoo.layers.summa_2d import Grid2D, summa_linear


class SummaLinearBase(placements.GridModule):
    """Shared by ParallelLinear2D and ParallelLinear2p5D; ``mode`` picks the mesh layout.

    x: [B/(d*q), ..., in/q] (the mode's canonical placement) -> y: [B/(d*q), ..., out/q] (same
    placement); d = 1 in 2D."""

    mode = "2d"
    any_placement = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mesh, dtype=None, device=None,
                 placement: ActivationPlacement | None = None):
        super().__init__()
        self._check(in_features, out_features, mesh)  # before drawing a serial layer of the wrong size
        serial = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, placement=placement)

    @classmethod
    def _check(cls, in_features: int, out_features: int, mesh) -> None:
        placements.check_mesh(mesh, cls.mode, cls.__name__)
        q = mesh.q
        placements.check_divisible(cls.__name__, "in_features", in_features, q, f"q={q}")
        placements.check_divisible(cls.__name__, "out_features", out_features, q, f"q={q}")

    def _setup(self, serial: nn.Linear, mesh, device, placement: ActivationPlacement | None = None) -> None:
        self._check(serial.in_features, serial.out_features, mesh)
        self._bind(mesh, placement)
        self.in_features, self.out_features = serial.in_features, serial.out_features
        self.grid = Grid2D(mesh)
        q, i, j = mesh.q, self.grid.i, self.grid.j
        device = device if device is not None else default_device(mesh)
        w_spec = ShardSpec.split(
            tuple(serial.weight.shape), {0: (j, q), 1: (i, q)}, ("tp_row", "tp_col"), self.placement.replica_axes
        )
        shard_param(self, "weight", serial.weight, w_spec, device)
        if serial.bias is not None:  # b[out block j], replicated over the batch axes
            placements.block_param(self, "bias", serial.bias, 0, mesh, self.placement, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/(d*q), ..., in/q] -> [B/(d*q), ..., out/q]."""
        q = self.mesh.q
        placements.check_local_input(type(self).__name__, x, self.in_features, q)
        weight = self.param("weight")
        if self.placement.replica_axes:  # 2.5D: replicated over depth, so the gradient is summed there
            weight = comm.copy_to(weight, self.mesh.group(*self.placement.replica_axes))
        y = summa_linear(x, weight.t(), self.grid)
        if self.bias is not None:
            y = y + placements.use_block_param(self.param("bias"), self.mesh, self.placement)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"q={self.mesh.q}, depth={self.mesh.tp_depth}")


class ParallelLinear2D(SummaLinearBase):
    """2D (Optimus / SUMMA) linear layer; drop-in for ``nn.Linear`` on a tp_mode="2d" mesh.

    Args: as nn.Linear, plus ``mesh`` (tp = q*q). in_features and out_features must be
    divisible by q. Input / output: the 2D layout [B/q, ..., features/q] (batch over tp_row,
    features over tp_col)."""

    mode = "2d"
