"""LayerNorm / RMSNorm over a hidden dimension split across a tp group (2D, and the bases of
2.5D / 3D).

x: [B/parts, ..., H/q], hidden split over the placement's ``hidden_axis``. The mean and the
variance are sums over the full hidden size, so each is a local partial sum followed by an
all-reduce over the hidden group (two-pass: mean, then centred squares, as nn.LayerNorm).
The backward is written out rather than left to autograd: with xhat = (x - mean) * rstd and
g the gradient of xhat, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), where both means run
over the full hidden size, so one all-reduce of the two row sums serves the whole backward.
This is the formula of the serial kernels, so the parallel and serial gradients round alike
(autograd through two chained all-reduces differs from them by cancellation in near-zero
entries).

RMSNorm needs one statistic, the mean of squares: a local sum all-reduced over the hidden
group by ``comm.all_reduce`` (whose backward all-reduces too), left to autograd.

weight / bias hold the hidden block of this rank, replicated over the batch axes; their
gradients are summed there (``copy_to``).
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo import comm
from shardzoo.comm import ops
from shardzoo.layers import placements
from shardzoo.layers.placements import ActivationPlacement


class _SplitNormalize(torch.autograd.Function):
    """(x - mean) / sqrt(var + eps) over a last dim split across ``group`` (full size ``hidden``).
    x: [..., hidden / p] -> same; statistics in at least fp32."""

    @staticmethod
    def forward(ctx, x, group, hidden: int, eps: float):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        mean = ops.all_reduce(xf.sum(-1, keepdim=True), group, inplace=True) / hidden
        centred = xf - mean
        var = ops.all_reduce((centred * centred).sum(-1, keepdim=True), group, inplace=True) / hidden
        rstd = torch.rsqrt(var + eps)
        xhat = centred * rstd
        ctx.save_for_backward(xhat, rstd)
        ctx.group, ctx.hidden = group, hidden
        return xhat.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd = ctx.saved_tensors
        g = grad.to(xhat.dtype)
        sums = torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1)
        sums = ops.all_reduce(sums, ctx.group, inplace=True) / ctx.hidden
        dx = rstd * (g - sums[..., :1] - xhat * sums[..., 1:])
        return dx.to(grad.dtype), None, None, None


class _GridNorm(placements.GridModule):
    """Shared by the grid LayerNorm / RMSNorm: the hidden-block parameters and the input check."""

    def _setup(self, serial: nn.Module, mesh, device, placement: ActivationPlacement | None = None) -> None:
        self._bind(mesh, placement)
        name = type(self).__name__
        if len(serial.normalized_shape) != 1:
            raise ValueError(f"{name} normalises one (the last) dim; got normalized_shape={serial.normalized_shape}")
        self.normalized_shape, self.eps = tuple(serial.normalized_shape), serial.eps
        hidden = self.normalized_shape[0]
        q = mesh.size(self.placement.hidden_axis)
        placements.check_divisible(name, "normalized_shape", hidden, q, f"q={q}")
        for pname in self.param_names:
            full = getattr(serial, pname, None)
            if full is None:
                self.register_parameter(pname, None)
            else:
                placements.block_param(self, pname, full, 0, mesh, self.placement, device)

    def _group(self, x: torch.Tensor):
        """The hidden group, after checking that ``x`` is a local block [..., H/q]."""
        hidden, q = self.normalized_shape[0], self.mesh.size(self.placement.hidden_axis)
        if x.shape[-1] * q != hidden:
            raise ValueError(
                f"{type(self).__name__} expects the local block [..., H/q={hidden // q}]; "
                f"got shape {tuple(x.shape)}. Enter the parallel region with module.shard_input(x_full)"
            )
        return self.mesh.group(self.placement.hidden_axis)

    def _affine(self, y: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            y = y * placements.use_block_param(self.weight, self.mesh, self.placement)
        if getattr(self, "bias", None) is not None:
            y = y + placements.use_block_param(self.bias, self.mesh, self.placement)
        return y

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, placement=({self.placement})"


class GridLayerNorm(_GridNorm):
    """LayerNorm whose normalised (last) dim is split over ``placement.hidden_axis``.

    Args: as nn.LayerNorm for a single normalised dim (``normalized_shape`` an int H), plus
    ``mesh`` and ``placement`` (default the mode's canonical placement). H must be divisible by q.
    Shapes: [B/parts, ..., H/q] -> same."""

    param_names = ("weight", "bias")

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 *, mesh, dtype=None, device=None, placement: ActivationPlacement | None = None):
        super().__init__()
        serial = nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias=bias, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/parts, ..., H/q] -> [B/parts, ..., H/q]."""
        group = self._group(x)
        return self._affine(_SplitNormalize.apply(x, group, self.normalized_shape[0], self.eps))


class GridRMSNorm(_GridNorm):
    """RMSNorm whose normalised (last) dim is split over ``placement.hidden_axis``.

    Args: as nn.RMSNorm for a single normalised dim (eps None: the dtype's machine epsilon),
    plus ``mesh`` and ``placement``. H must be divisible by q. Shapes: [B/parts, ..., H/q] -> same."""

    param_names = ("weight",)

    def __init__(self, normalized_shape: int, eps: float | None = None, elementwise_affine: bool = True, *, mesh,
                 dtype=None, device=None, placement: ActivationPlacement | None = None):
        super().__init__()
        serial = nn.RMSNorm(normalized_shape, eps, elementwise_affine, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/parts, ..., H/q] -> [B/parts, ..., H/q]."""
        group = self._group(x)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        mean_sq = comm.all_reduce((xf * xf).sum(-1, keepdim=True), group) / self.normalized_shape[0]
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return self._affine((xf * torch.rsqrt(mean_sq + eps)).to(x.dtype))


class LayerNorm2D(GridLayerNorm):
    """LayerNorm on the 2D layout: x [B/q, ..., H/q] (hidden over tp_col); drop-in for
    ``nn.LayerNorm(H)`` on a tp_mode="2d" mesh."""

    mode = "2d"


class RMSNorm2D(GridRMSNorm):
    """RMSNorm on the 2D layout: x [B/q, ..., H/q] (hidden over tp_col); drop-in for
    ``nn.RMSNorm(H)`` on a tp_mode="2d" mesh."""

    mode = "2d"
