"""Attention block kernel: Triton (interpreter on CPU) vs torch reference vs plain SDPA."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.kernels import attention_block_backward, attention_block_forward, flash_attention
from shardzoo.testing.kernels import (
    DEVICE,
    DTYPES,
    GRAD_TOL,
    OUT_TOL,
    TRITON_RUNNABLE,
    assert_close,
    needs_triton,
    random_padding_mask,
    randn,
    sdpa_attention,
)
from shardzoo.testing.dtypes import KERNEL_LSE_TOL as LSE_TOL

BACKENDS = [pytest.param("triton", marks=needs_triton), "aten", "torch"]


def check_attention(backend, b, h, sq, sk, d, dtype, causal, mask_kind, seed):
    """Forward (out, lse) and backward of one configuration against SDPA; with Triton also
    the block backward against the reference at fp32 tolerance."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, b, h, sq, d, dtype=dtype)
    k = randn(gen, b, h, sk, d, dtype=dtype)
    v = randn(gen, b, h, sk, d, dtype=dtype)
    dout = randn(gen, b, h, sq, d, dtype=dtype)
    kpm = None if mask_kind == "none" else random_padding_mask(gen, b, sk, empty_row=mask_kind == "empty_row")

    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    want_out, want_lse = sdpa_attention(qr, kr, vr, causal, kpm)
    want_out.backward(dout.float())

    out, lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, want_out, OUT_TOL[dtype], scale_atol=False)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite], LSE_TOL, scale_atol=False)
    assert (out[~finite] == 0).all()

    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out_a = flash_attention(qa, ka, va, causal=causal, key_padding_mask=kpm, backend=backend)
    out_a.backward(dout)
    assert_close(out_a, want_out, OUT_TOL[dtype], scale_atol=False)
    for name, got, want in (("dq", qa.grad, qr.grad), ("dk", ka.grad, kr.grad), ("dv", va.grad, vr.grad)):
        assert got.dtype == dtype and not got.isnan().any(), name
        assert_close(got, want, GRAD_TOL[dtype], msg=f"{name} vs SDPA autograd")

    if backend == "triton":
        grads = attention_block_backward(dout, q, k, v, out, lse, causal=causal, key_padding_mask=kpm,
                                         backend="triton")
        ref = attention_block_backward(dout, q, k, v, out, lse, causal=causal, key_padding_mask=kpm,
                                       backend="torch")
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            assert got.dtype == torch.float32
            assert_close(got, want, GRAD_TOL[torch.float32], msg=f"{name}: triton vs torch reference")


attention_cases = dict(
    b=st.integers(1, 2), h=st.integers(1, 2), sq=st.integers(1, 40), sk=st.integers(1, 40),
    d=st.sampled_from([32, 48, 64]), dtype=st.sampled_from(DTYPES), causal=st.booleans(),
    mask_kind=st.sampled_from(["none", "random", "empty_row"]), seed=st.integers(0, 2**16),
)


@needs_triton
@settings(max_examples=10, deadline=None)
@given(**attention_cases)
def test_triton_attention_matches_sdpa(b, h, sq, sk, d, dtype, causal, mask_kind, seed):
    check_attention("triton", b, h, sq, sk, d, dtype, causal, mask_kind, seed)


@settings(max_examples=30, deadline=None)
@given(**attention_cases)
def test_reference_attention_matches_sdpa(b, h, sq, sk, d, dtype, causal, mask_kind, seed):
    check_attention("torch", b, h, sq, sk, d, dtype, causal, mask_kind, seed)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the aten backend runs CPU tensors")
@settings(max_examples=30, deadline=None)
@given(**attention_cases)
def test_cpu_fused_attention_matches_sdpa(b, h, sq, sk, d, dtype, causal, mask_kind, seed):
    check_attention("aten", b, h, sq, sk, d, dtype, causal, mask_kind, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,sq,sk", [(32, 45, 70), (48, 33, 17), (64, 31, 40), (128, 17, 24)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_and_ragged_lengths(backend, d, sq, sk, causal):
    check_attention(backend, 2, 2, sq, sk, d, torch.float32, causal, "random", seed=d + sq)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(backend, dtype):
    check_attention(backend, 1, 2, 37, 29, 64, dtype, True, "random", seed=7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zero_and_neg_inf(backend, causal):
    check_attention(backend, 2, 1, 19, 23, 32, torch.float32, causal, "empty_row", seed=3)
    # causal with key 0 masked: query 0 sees no key in any batch row
    gen = torch.Generator().manual_seed(0)
    q, k, v = (randn(gen, 1, 1, 5, 32) for _ in range(3))
    kpm = torch.ones(1, 5, dtype=torch.bool, device=DEVICE)
    kpm[0, 0] = False
    out, lse = attention_block_forward(q, k, v, causal=True, key_padding_mask=kpm, backend=backend)
    assert torch.isneginf(lse[0, 0, 0]) and (out[0, 0, 0] == 0).all() and torch.isfinite(lse[0, 0, 1:]).all()
    grads = attention_block_backward(torch.ones_like(q), q, k, v, out, lse, causal=True, key_padding_mask=kpm,
                                     backend=backend)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0, 0, 0] == 0).all()


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton)])
def test_triton_larger_fixed_case(backend):
    check_attention(backend, 1, 2, 128, 128, 64, torch.bfloat16, True, "random", seed=11)


@pytest.mark.parametrize("backend", ["aten", "torch"])
def test_large_fixed_case(backend):
    # the reference: several key chunks (256) and query chunks (1024) with the default sizes
    check_attention(backend, 1, 2, 1100, 600, 64, torch.float32, True, "random", seed=5)


def test_explicit_softmax_scale():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (randn(gen, 1, 2, 9, 32) for _ in range(3))
    want, want_lse = sdpa_attention(q, k, v, softmax_scale=0.3)
    for backend in ("torch", "aten", "triton") if TRITON_RUNNABLE else ("torch", "aten"):
        out, lse = attention_block_forward(q, k, v, softmax_scale=0.3, backend=backend)
        assert_close(out, want, OUT_TOL[torch.float32], scale_atol=False)
        assert_close(lse, want_lse, LSE_TOL, scale_atol=False)


@pytest.mark.parametrize("backend", ["aten", "torch"])
def test_float64_on_cpu_backends(backend):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (randn(gen, 1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    out, lse = attention_block_forward(q, k, v, causal=True, backend=backend)
    want, want_lse = sdpa_attention(q.double(), k.double(), v.double(), causal=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
