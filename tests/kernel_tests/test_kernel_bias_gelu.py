"""Fused bias + GeLU: Triton (interpreter on CPU) vs torch reference vs F.gelu."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.kernels import bias_gelu, bias_gelu_backward, bias_gelu_forward
from shardzoo.testing.kernels import DEVICE, DTYPES, GRAD_TOL, OUT_TOL, assert_close, needs_triton, randn

BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]


def check_bias_gelu(backend, shape, dtype, approximate, has_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    dy = randn(gen, *shape, dtype=dtype)
    bias = randn(gen, shape[-1], dtype=dtype) if has_bias else None

    xr = x.detach().float().requires_grad_()
    br = bias.detach().float().requires_grad_() if has_bias else None
    want = F.gelu(xr + br if has_bias else xr, approximate=approximate)
    want.backward(dy.float())

    y = bias_gelu_forward(x, bias, approximate, backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, want, OUT_TOL[dtype], scale_atol=False)
    dx, db = bias_gelu_backward(dy, x, bias, approximate, backend)
    assert_close(dx, xr.grad, GRAD_TOL[dtype], scale_atol=False)
    assert (db is None) == (bias is None)
    if has_bias:
        assert db.dtype == torch.float32
        assert_close(db, br.grad, GRAD_TOL[dtype])
    if backend == "triton":
        ref_dx, _ = bias_gelu_backward(dy, x, bias, approximate, "torch")
        assert_close(dx, ref_dx, GRAD_TOL[dtype], scale_atol=False)

    xa = x.detach().clone().requires_grad_()
    ba = bias.detach().clone().requires_grad_() if has_bias else None
    out = bias_gelu(xa, ba, approximate, backend)
    out.backward(dy)
    assert_close(out, want, OUT_TOL[dtype], scale_atol=False)
    assert_close(xa.grad, xr.grad, GRAD_TOL[dtype], scale_atol=False)
    if has_bias:
        assert ba.grad.dtype == dtype
        assert_close(ba.grad, br.grad, GRAD_TOL[dtype])


cases = dict(
    lead=st.lists(st.integers(1, 6), min_size=0, max_size=2), n=st.integers(1, 200),
    dtype=st.sampled_from(DTYPES), approximate=st.sampled_from(["none", "tanh"]), has_bias=st.booleans(),
    seed=st.integers(0, 999),
)


@needs_triton
@settings(max_examples=15, deadline=None)
@given(**cases)
def test_triton_bias_gelu(lead, n, dtype, approximate, has_bias, seed):
    check_bias_gelu("triton", (*lead, n), dtype, approximate, has_bias, seed)


@settings(max_examples=30, deadline=None)
@given(**cases)
def test_reference_bias_gelu(lead, n, dtype, approximate, has_bias, seed):
    check_bias_gelu("torch", (*lead, n), dtype, approximate, has_bias, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_fixed_cases(backend, approximate, dtype):
    check_bias_gelu(backend, (3, 17, 512), dtype, approximate, True, seed=2)
    check_bias_gelu(backend, (5, 7), dtype, approximate, False, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_extreme_values(backend, approximate):
    x = torch.tensor([[-1e4, -30.0, -5.0, 0.0, 5.0, 30.0, 1e4]], device=DEVICE)
    y = bias_gelu_forward(x, None, approximate, backend)
    assert torch.isfinite(y).all()
    assert_close(y, F.gelu(x, approximate=approximate), OUT_TOL[torch.float32], scale_atol=False)
    dx, _ = bias_gelu_backward(torch.ones_like(x), x, None, approximate, backend)
    assert torch.isfinite(dx).all()


def test_bias_gelu_errors():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="bias has 4 elements but x's last dim is 8"):
        bias_gelu_forward(x, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="approximate='exact'"):
        bias_gelu_forward(x, None, approximate="exact")
