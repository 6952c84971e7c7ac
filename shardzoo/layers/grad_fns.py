"""Identity functions that change only the gradient flowing back through them."""

from __future__ import annotations

import torch


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` [any shape] unchanged; its gradient times ``factor``."""
    return _ScaleGrad.apply(x, factor)


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` [any shape] unchanged; its gradient made contiguous (for a receiver or kernel that
    needs the strides it allocates: torch's pipeline stage, the grouped matmul's backward)."""
    return _ContiguousGrad.apply(x)
