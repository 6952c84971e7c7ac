"""SUMMA block matrix products on a q x q grid: the core of the 2D and 2.5D layers.

Rank (i, j) of the grid (i = its "tp_row" coordinate, j = its "tp_col" coordinate) holds block
(i, j) of every matrix. ``row`` is the group of the ranks in its grid row (same i, all j; the
"tp_col" axis group), ``col`` the group of its grid column (same j, all i; "tp_row"). In 2.5D the
groups live inside one depth slice, so the same code serves both modes.

Three products, each a loop of q steps with one broadcast and one broadcast or reduce per step
(ring byte model: a broadcast or reduce of n bytes sends (q-1)/q * n):

==== ==================================== ================================================
name result block (i, j)                   step k
==== ==================================== ================================================
nn   C_ij = sum_k A_ik B_kj                broadcast A_ik along the row, B_kj along the column
nt   C_ik = sum_j A_ij B_kj^T              broadcast B_kj along the column, reduce to (i, k)
tn   C_kj = sum_i A_ik^T B_ij              broadcast A_ik along the row, reduce to (k, j)
==== ==================================== ================================================

``SummaLinear`` (y = x W^T, W stored transposed as A = W^T) is nn forward, nt + tn backward;
``SummaLinearT`` (y = x E^T with E stored as is, e.g. a tied embedding) is nt forward,
nn + tn backward. Only the local blocks are saved for backward (the paper's memory model):
backward broadcasts them again instead of keeping q broadcast copies alive.
"""

from __future__ import annotations

import torch

from shardzoo.comm import ops
from shardzoo.layers.needed_grads import grads_needed, mark_tensors


class Grid2D:
    """The two groups and coordinates of this rank's q x q SUMMA grid."""

    def __init__(self, mesh):
        self.q = mesh.q
        self.row = mesh.group("tp_col")  # same grid row i, indexed by column j
        self.col = mesh.group("tp_row")  # same grid column j, indexed by row i
        self.i = mesh.rank("tp_row")
        self.j = mesh.rank("tp_col")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [prod(...), n] (leading dims are independent rows of the product)."""
    return t.reshape(-1, t.shape[-1])


def summa_nn(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """C_ij = sum_k A_ik B_kj. a: [..., m/q], b: [m/q, n/q] -> [..., n/q]."""
    out = None
    for k in range(grid.q):
        a_k = ops.broadcast(a, grid.row, k)
        b_k = ops.broadcast(b, grid.col, k)
        part = torch.matmul(a_k, b_k)
        out = part if out is None else out.add_(part)
    return out


def summa_nt(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """C_ik = sum_j A_ij B_kj^T. a: [..., n/q], b: [m/q, n/q] -> [..., m/q]."""
    mine = None
    for k in range(grid.q):
        b_k = ops.broadcast(b, grid.col, k)
        part = ops.reduce(torch.matmul(a, b_k.t()), grid.row, k)
        if k == grid.j:
            mine = part
    return mine


def summa_tn(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """C_kj = sum_i A_ik^T B_ij over the flattened leading dims.
    a: [..., m/q], b: [..., n/q] -> [m/q, n/q]."""
    b2 = _rows(b)
    mine = None
    for k in range(grid.q):
        a_k = _rows(ops.broadcast(a, grid.row, k))
        part = ops.reduce(a_k.t().matmul(b2), grid.col, k)
        if k == grid.i:
            mine = part
    return mine


class SummaLinear(torch.autograd.Function):
    """y = x @ a with a = W^T stored as block (i, j) on rank (i, j).

    x: [..., in/q] (block (i, j) of x), a: [in/q, out/q] -> y: [..., out/q]."""

    @staticmethod
    def forward(ctx, x, a, grid):
        ctx.grid = grid
        mark_tensors(ctx, x, a, grid)
        ctx.save_for_backward(x, a)
        return summa_nn(x, a, grid)

    @staticmethod
    def backward(ctx, dy):
        x, a = ctx.saved_tensors
        dy = dy.contiguous()
        need_x, need_a = grads_needed(ctx)[:2]  # a split backward asks for one of them
        dx = summa_nt(dy, a, ctx.grid) if need_x else None
        da = summa_tn(x, dy, ctx.grid) if need_a else None
        return dx, da, None


class SummaLinearT(torch.autograd.Function):
    """y = x @ e^T with e stored as block (i, j) on rank (i, j) (vocab over rows, hidden over
    columns: the layout of a 2D vocab-parallel embedding, so a head can share its weight).

    x: [..., h/q], e: [v/q, h/q] -> y: [..., v/q]."""

    @staticmethod
    def forward(ctx, x, e, grid):
        ctx.grid = grid
        mark_tensors(ctx, x, e, grid)
        ctx.save_for_backward(x, e)
        return summa_nt(x, e, grid)

    @staticmethod
    def backward(ctx, dy):
        x, e = ctx.saved_tensors
        dy = dy.contiguous()
        need_x, need_e = grads_needed(ctx)[:2]
        dx = summa_nn(dy, e, ctx.grid) if need_x else None
        de = summa_tn(dy, x, ctx.grid) if need_e else None
        return dx, de, None


def summa_linear(x: torch.Tensor, a: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Differentiable block (i, j) of x @ A; see :class:`SummaLinear`."""
    return SummaLinear.apply(x.contiguous(), a, grid)


def summa_linear_t(x: torch.Tensor, e: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Differentiable block (i, j) of x @ E^T; see :class:`SummaLinearT`."""
    return SummaLinearT.apply(x.contiguous(), e, grid)
