"""Fused LayerNorm: Triton (interpreter on CPU) vs torch reference vs F.layer_norm."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.kernels import fused_layer_norm, layer_norm_backward, layer_norm_forward
from shardzoo.testing.kernels import DEVICE, DTYPES, GRAD_TOL, OUT_TOL, assert_close, needs_triton, randn

BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]


def check_layer_norm(backend, shape, dtype, affine, seed, eps=1e-5):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = randn(gen, *shape, dtype=dtype, scale=2.0) + 0.5
    dy = randn(gen, *shape, dtype=dtype)
    weight = randn(gen, n, dtype=dtype) if affine in ("weight", "both") else None
    bias = randn(gen, n, dtype=dtype) if affine == "both" else None

    # the reference in float64: in float32, F.layer_norm's own rounding is amplified by rstd when a
    # row's variance is tiny (one-element rows: x - mean should be exactly 0)
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    want = F.layer_norm(leaves[0], (n,), leaves[1], leaves[2], eps)
    want.backward(dy.double())

    y, mean, rstd = layer_norm_forward(x, weight, bias, eps, backend)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32 and mean.shape == shape[:-1]
    assert_close(y, want, OUT_TOL[dtype], scale_atol=False)
    assert_close(mean, x.float().mean(-1), OUT_TOL[torch.float32], scale_atol=False)
    var = x.float().var(-1, unbiased=False)
    assert_close(rstd, torch.rsqrt(var + eps), (1e-5, 1e-4), scale_atol=False)

    dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd, backend)
    assert_close(dx, leaves[0].grad, GRAD_TOL[dtype])
    assert (dw is None) == (weight is None)
    if weight is not None:
        assert_close(dw, leaves[1].grad, GRAD_TOL[dtype])
    assert_close(db, dy.float().reshape(-1, n).sum(0), GRAD_TOL[dtype])
    if backend == "triton":  # kernel vs reference on identical inputs
        ref = layer_norm_backward(dy, x, weight, mean, rstd, "torch")
        assert_close(dx, ref[0], GRAD_TOL[dtype])
        if weight is not None:
            assert_close(dw, ref[1], GRAD_TOL[torch.float32])

    params = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    out = fused_layer_norm(params[0], params[1], params[2], eps, backend)
    out.backward(dy)
    assert_close(out, want, OUT_TOL[dtype], scale_atol=False)
    for got, leaf in zip(params, leaves):
        if got is not None:
            assert got.grad.dtype == dtype
            assert_close(got.grad, leaf.grad, GRAD_TOL[dtype])


cases = dict(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=2), n=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES), affine=st.sampled_from(["none", "weight", "both"]), seed=st.integers(0, 999),
)


@needs_triton
@settings(max_examples=15, deadline=None)
@given(**cases)
def test_triton_layer_norm(lead, n, dtype, affine, seed):
    check_layer_norm("triton", (*lead, n), dtype, affine, seed)


@settings(max_examples=30, deadline=None)
@given(**cases)
def test_reference_layer_norm(lead, n, dtype, affine, seed):
    check_layer_norm("torch", (*lead, n), dtype, affine, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_wide_rows(backend, dtype):
    check_layer_norm(backend, (3, 11, 4096), dtype, "both", seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_non_contiguous_input(backend):
    gen = torch.Generator().manual_seed(0)
    x = randn(gen, 6, 40).t()  # [40, 6], last-dim stride 40
    y, _, _ = layer_norm_forward(x, None, None, 1e-5, backend)
    assert_close(y, F.layer_norm(x, (6,)), OUT_TOL[torch.float32], scale_atol=False)


def test_layer_norm_errors():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight has 7 elements but x's last dim is 8"):
        layer_norm_forward(x, torch.ones(7, device=DEVICE), None)
    with pytest.raises(ValueError, match="x.dtype=torch.int64"):
        layer_norm_forward(torch.ones(2, 8, dtype=torch.long, device=DEVICE), None, None)
    with pytest.raises(ValueError, match="backend='fast'"):
        layer_norm_forward(x, None, None, backend="fast")
