"""LayerNorm over a hidden dimension split across a tp group (2D, and the base of 2.5D / 3D).

x: [B/parts, ..., H/q], hidden split over the layout's ``hidden_axis``. The mean and the
variance are sums over the full hidden size, so each is a local partial sum followed by an
all-reduce over the hidden group. Every rank uses the reduced statistic for its own block, so
the backward must sum the gradients from all ranks: ``comm.all_reduce`` (the per-rank-consumer
adjoint), not ``reduce_from``. Two-pass (mean, then centred squares) as in nn.LayerNorm.

weight / bias hold the hidden block of this rank, replicated over the batch axes; their
gradients are summed there (``copy_to``).
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo import comm
from shardzoo.layers import layouts
from shardzoo.layers.layouts import ActivationLayout


class GridLayerNorm(layouts.GridModule):
    """LayerNorm whose normalised (last) dim is split over ``layout.hidden_axis``.

    Args: as nn.LayerNorm for a single normalised dim (``normalized_shape`` an int H), plus
    ``mesh`` and ``layout`` (default the mode's canonical layout). H must be divisible by q.
    Shapes: [B/parts, ..., H/q] -> same."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 *, mesh, dtype=None, device=None, layout: ActivationLayout | None = None):
        super().__init__()
        serial = nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias=bias, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, layout)

    @classmethod
    def from_serial(cls, module: nn.LayerNorm, mesh, device=None, layout: ActivationLayout | None = None):
        """This rank's hidden block of an existing ``nn.LayerNorm`` (one normalised dim)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(module, mesh, device, layout)
        return self

    def _setup(self, serial: nn.LayerNorm, mesh, device, layout) -> None:
        self._bind(mesh, layout)
        name = type(self).__name__
        if len(serial.normalized_shape) != 1:
            raise ValueError(f"{name} normalises one (the last) dim; got normalized_shape={serial.normalized_shape}")
        self.normalized_shape, self.eps = tuple(serial.normalized_shape), serial.eps
        hidden = self.normalized_shape[0]
        q = mesh.size(self.layout.hidden_axis)
        layouts.check_divisible(name, "normalized_shape", hidden, q, f"q={q}")
        for pname in ("weight", "bias"):
            full = getattr(serial, pname)
            if full is None:
                self.register_parameter(pname, None)
            else:
                setattr(self, pname, layouts.block_param(full, 0, mesh, self.layout, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/parts, ..., H/q] -> [B/parts, ..., H/q]."""
        hidden, q = self.normalized_shape[0], self.mesh.size(self.layout.hidden_axis)
        group = self.mesh.group(self.layout.hidden_axis)
        if x.shape[-1] * q != hidden:
            raise ValueError(
                f"{type(self).__name__} expects the local block [..., H/q={hidden // q}]; "
                f"got shape {tuple(x.shape)}. Enter the parallel region with module.shard_input(x_full)"
            )
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in at least fp32
        mean = comm.all_reduce(xf.sum(-1, keepdim=True), group) / hidden
        centred = xf - mean
        var = comm.all_reduce((centred * centred).sum(-1, keepdim=True), group) / hidden
        y = (centred * torch.rsqrt(var + self.eps)).to(x.dtype)
        if self.weight is not None:
            y = y * layouts.use_block_param(self.weight, self.mesh, self.layout)
        if self.bias is not None:
            y = y + layouts.use_block_param(self.bias, self.mesh, self.layout)
        return y

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, layout=({self.layout})"


class LayerNorm2D(GridLayerNorm):
    """LayerNorm on the 2D layout: x [B/q, ..., H/q] (hidden over tp_col); drop-in for
    ``nn.LayerNorm(H)`` on a tp_mode="2d" mesh."""

    mode = "2d"
