"""ParallelLinear3D (Bian et al.): y = x W^T + b on a q x q x q cube, tp = q^3.

For an input placement (I, J | L) (batch split over I then J, features over L; canonical:
I=tp_x, J=tp_y, L=tp_z), rank (i, j, l) holds

* x block [batch block i*q + j of q^2, in block l of q]        [B/q^2, ..., in/q]
* W block [out block j*q + i of q^2, in block l of q]          [out/q^2, in/q]
* b block [out block j of q] (replicated over I and L)         [out/q]

Forward (the paper's 3D matmul): all-gather x over J (batch) -> [B/q, in/q]; all-gather W over
I (out) -> W[out block j, in block l]; multiply; reduce-scatter over L (batch) ->
y [batch block i*q + l, out block j] = [B/q^2, ..., out/q]. The output placement is (I, L | J):
J and L swap roles. Backward is the adjoint of each step (autograd on comm.all_gather /
comm.reduce_scatter): all-gather dy over L, reduce-scatter dx over J and dW over I.

Chaining (e.g. an MLP): the second layer takes the first layer's output placement::

    fc1 = ParallelLinear3D(h, 4 * h, mesh=mesh)                                # (x, y | z) -> (x, z | y)
    fc2 = ParallelLinear3D(4 * h, h, mesh=mesh, placement=fc1.output_placement)  # (x, z | y) -> (x, y | z)

so the block ends in the placement it started with and residual adds line up.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo import comm
from shardzoo.comm.mesh import default_device
from shardzoo.layers import placements
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.shard_spec import ShardSpec, shard_param


def linear_3d(x: torch.Tensor, weight: torch.Tensor, mesh, placement: ActivationPlacement) -> torch.Tensor:
    """The 3D product for input placement (I, J | L). x: [B/q^2, ..., in/q], weight:
    [out/q^2, in/q] (block j*q+i, l) -> [B/q^2, ..., out/q] in placement (I, L | J)."""
    (i_axis, j_axis), l_axis = placement.batch_axes, placement.hidden_axis
    x_il = comm.all_gather(x, mesh.group(j_axis), 0)  # [B/q, ..., in/q]
    w_jl = comm.all_gather(weight, mesh.group(i_axis), 0)  # [out/q, in/q]
    partial = torch.matmul(x_il, w_jl.t())  # [B/q, ..., out/q], summed over L next
    return comm.reduce_scatter(partial, mesh.group(l_axis), 0)


def weight_spec_3d(global_shape: tuple[int, int], mesh, placement: ActivationPlacement) -> ShardSpec:
    """Spec of the [out, in] weight block (out block j*q + i of q^2, in block l of q)."""
    (i_axis, j_axis), l_axis = placement.batch_axes, placement.hidden_axis
    q = mesh.q
    out_index = mesh.rank(j_axis) * q + mesh.rank(i_axis)
    return ShardSpec.split(global_shape, {0: (out_index, q * q), 1: (mesh.rank(l_axis), q)}, ("tp",))


class ParallelLinear3D(placements.GridModule):
    """3D linear layer; drop-in for ``nn.Linear`` on a tp_mode="3d" mesh.

    Args: as nn.Linear, plus ``mesh`` (tp = q^3) and ``placement`` (the input placement; default
    the canonical (tp_x, tp_y | tp_z); pass ``previous_layer.output_placement`` to chain; also
    accepted as ``input_placement``). in_features must be divisible by q, out_features by q*q.
    Input: [B/q^2, ..., in/q] in ``input_placement``; output: [B/q^2, ..., out/q] in
    ``output_placement``."""

    mode = "3d"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mesh, dtype=None, device=None,
                 placement: ActivationPlacement | None = None, input_placement: ActivationPlacement | None = None):
        super().__init__()
        self._check(in_features, out_features, mesh)  # before drawing a serial layer of the wrong size
        serial = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, placement=placement, input_placement=input_placement)

    @classmethod
    def _check(cls, in_features: int, out_features: int, mesh) -> None:
        placements.check_mesh(mesh, "3d", cls.__name__)
        q = mesh.q
        placements.check_divisible(cls.__name__, "in_features", in_features, q, f"q={q}")
        placements.check_divisible(cls.__name__, "out_features", out_features, q * q, f"q*q={q * q}")

    def _setup(self, serial: nn.Linear, mesh, device, placement: ActivationPlacement | None = None,
               input_placement: ActivationPlacement | None = None) -> None:
        if placement is not None and input_placement is not None and placement != input_placement:
            raise ValueError("ParallelLinear3D got both placement= and input_placement= (the same argument under "
                             "two names) with different values; pass one of them")
        self._check(serial.in_features, serial.out_features, mesh)
        self._bind(mesh, placement or input_placement)
        self.in_features, self.out_features = serial.in_features, serial.out_features
        device = device if device is not None else default_device(mesh)
        w_spec = weight_spec_3d(tuple(serial.weight.shape), mesh, self.input_placement)
        shard_param(self, "weight", serial.weight, w_spec, device)
        if serial.bias is not None:  # b[out block j], replicated over the output's batch axes
            placements.block_param(self, "bias", serial.bias, 0, mesh, self.output_placement, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/q^2, ..., in/q] (input_placement) -> [B/q^2, ..., out/q] (output_placement)."""
        q = self.mesh.q
        placements.check_local_input("ParallelLinear3D", x, self.in_features, q)
        y = linear_3d(x, self.param("weight"), self.mesh, self.input_placement)
        if self.bias is not None:
            y = y + placements.use_block_param(self.param("bias"), self.mesh, self.output_placement)
        return y

    @property
    def input_placement(self) -> ActivationPlacement:
        return self.placement

    @property
    def output_placement(self) -> ActivationPlacement:
        """(I, L | J) for an input placement (I, J | L)."""
        return placements.swapped_3d(self.placement)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"q={self.mesh.q}, input_placement=({self.input_placement})")
