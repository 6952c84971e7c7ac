"""Every autograd collective against its analytic forward and adjoint, on 1, 2, 4 and 8 ranks.

Each rank can rebuild every rank's input X_s and output gradient G_s from the seed, so the
expected forward output and input gradient are computed locally and compared exactly (up to
the dtype's summation tolerance)."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from shardzoo import comm
from shardzoo.testing import assert_close, dtypes, run_on_ranks

OPS = ["copy_to", "reduce_from", "all_reduce", "scatter_to", "gather_from", "all_gather",
       "reduce_scatter", "all_to_all", "broadcast"]  # fmt: skip
DTYPES = dtypes("fp32", "fp64", "bf16")


def _tensor(seed: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _expected(op, xs, gs, r, p, dim, dim2, src):
    """(forward output, input gradient) on rank r, from every rank's X_s and G_s."""
    cat = torch.cat
    if op == "copy_to":
        return xs[r], sum(gs)
    if op == "reduce_from":
        return sum(xs), gs[r]
    if op == "all_reduce":
        return sum(xs), sum(gs)
    if op == "scatter_to":  # the input is replicated: X_0 on every rank
        return xs[0].chunk(p, dim)[r], cat(gs, dim)
    if op == "gather_from":
        return cat(xs, dim), gs[r].chunk(p, dim)[r]
    if op == "all_gather":
        return cat(xs, dim), sum(g.chunk(p, dim)[r] for g in gs)
    if op == "reduce_scatter":
        return sum(xs).chunk(p, dim)[r], cat(gs, dim)
    if op == "all_to_all":
        out = cat([x.chunk(p, dim)[r] for x in xs], dim2)
        grad = cat([g.chunk(p, dim2)[r] for g in gs], dim)
        return out, grad
    if op == "broadcast":
        return xs[src], sum(gs) if r == src else torch.zeros_like(gs[r])
    raise AssertionError(op)


def _in_shape(op, shape, p, dim, dim2):
    """Input shape on each rank for a rank-local output shape ``shape``."""
    shape = list(shape)
    if op == "all_to_all":
        shape[dim] *= p
        shape[dim2] //= p
    elif op in ("scatter_to", "reduce_scatter"):
        shape[dim] *= p
    elif op in ("gather_from", "all_gather"):
        shape[dim] //= p
    return shape


def check_collective(op, shape, dim, dim2, dtype_name, seed, src):
    dtype = DTYPES[dtype_name]
    p, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    in_shape = _in_shape(op, shape, p, dim, dim2)
    xs = [_tensor(seed + 1000 * (0 if op == "scatter_to" else s), in_shape, dtype) for s in range(p)]
    x = xs[r].clone().requires_grad_(True)
    if op in ("scatter_to", "gather_from", "all_gather", "reduce_scatter"):
        y = getattr(comm, op)(x, group, dim)
    elif op == "all_to_all":
        y = comm.all_to_all(x, group, dim, dim2)
    elif op == "broadcast":
        y = comm.broadcast(x, group, src)
    else:
        y = getattr(comm, op)(x, group)
    gs = [_tensor(seed + 7 + 1000 * s, y.shape, dtype) for s in range(p)]
    y.backward(gs[r])
    exp_y, exp_g = _expected(op, xs, gs, r, p, dim, dim2, src)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert_close(y, exp_y, f"{op} forward", terms=p, parts=p)
    assert_close(x.grad, exp_g, f"{op} backward", terms=p, parts=p)
    return tuple(y.shape)


@st.composite
def collective_case(draw, p):
    op = draw(st.sampled_from(OPS))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 3)) * (p if op in ("gather_from", "all_gather", "all_to_all") else 1) for _ in range(ndim)]
    dim = draw(st.integers(0, ndim - 1))
    dim2 = draw(st.integers(0, ndim - 1))
    if op == "all_to_all":  # local output has shape[dim2] divisible by p (it was gathered)
        shape[dim] = draw(st.integers(1, 3))
        shape[dim2] = draw(st.integers(1, 3)) * p
    return op, shape, dim, dim2, draw(st.sampled_from(list(DTYPES))), draw(st.integers(0, 10**6)), draw(
        st.integers(0, p - 1)
    )


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@given(data=st.data())
def test_collective_matches_analytic_adjoint(world, data):
    op, shape, dim, dim2, dtype, seed, src = data.draw(collective_case(world))
    shapes = run_on_ranks(check_collective, world, op, shape, dim, dim2, dtype, seed, src)
    assert len(shapes) == world


@pytest.mark.parametrize("op", OPS)
def test_every_op_at_8_ranks_fixed_example(op):
    """The largest supported world, every op, a shape with several dims (regression guard)."""
    shape, dim, dim2 = [4, 8, 16], 1, 2
    if op == "all_to_all":
        shape = [2, 3, 16]
    run_on_ranks(check_collective, 8, op, shape, dim, dim2, "fp32", 1234, 3)


def uneven_split(op):
    x = torch.ones(3, 5)
    try:
        if op == "all_to_all":
            comm.all_to_all(x, dist.group.WORLD, 1, 0)
        else:
            getattr(comm, op)(x, dist.group.WORLD, 1)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("op", ["scatter_to", "reduce_scatter", "all_to_all"])
def test_uneven_split_raises_clear_error(op):
    messages = run_on_ranks(uneven_split, 2, op)
    for m in messages:
        assert m is not None and "5 is not divisible by 2" in m and "pad" in m


def test_size_one_group_is_identity_without_distributed():
    """Serial code paths: torch.distributed not initialised, every op is the identity."""
    assert not dist.is_initialized()
    x = torch.randn(4, 6, requires_grad=True)
    for op in ["copy_to", "reduce_from", "all_reduce"]:
        assert getattr(comm, op)(x, None) is x
    for op in ["scatter_to", "gather_from", "all_gather", "reduce_scatter"]:
        assert getattr(comm, op)(x, None, 1) is x
    assert comm.all_to_all(x, None, 0, 1) is x
    assert comm.broadcast(x, None, 0) is x


def _reduce_from_inplace(seed):
    p, r = dist.get_world_size(), dist.get_rank()
    xs = [_tensor(seed + s, (3, 5), torch.float64) for s in range(p)]
    w = xs[r].clone().requires_grad_(True)
    y = w * 2  # a fresh tensor nothing else reads
    out = comm.reduce_from(y, dist.group.WORLD, inplace=True)
    assert out is y, "inplace=True returns the summed input itself"
    assert_close(out.detach(), 2 * sum(xs), "reduce_from(inplace=True) output")
    g = _tensor(seed + 100 + r, (3, 5), torch.float64)
    out.backward(g)
    assert_close(w.grad, 2 * g, "reduce_from(inplace=True) input grad")  # identity backward


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_from_inplace_sums_into_its_input(world):
    run_on_ranks(_reduce_from_inplace, world, 7)
