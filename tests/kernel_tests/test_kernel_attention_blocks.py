"""How ring attention uses the block kernel: (out, lse) of key blocks merged by log-sum-exp
equal full attention, and per-block backward with the global lse sums to the full gradients.
Also the torch reference's chunking (memory) claim."""
import pytest
import torch

from shardzoo.kernels import attention_block_backward, attention_block_forward
from shardzoo.kernels import flash_attention_ref
from shardzoo.testing.kernels import (GRAD_TOL, OUT_TOL, LargestOutput, assert_close, needs_triton, random_padding_mask, randn,
                                      sdpa_attention)

BACKENDS = [pytest.param("triton", marks=needs_triton), "aten", "torch"]


def merge(o1, lse1, o2, lse2):
    """Merge two blocks' (out, lse) in fp32; rows where both are empty stay (0, -inf)."""
    lse = torch.logaddexp(lse1, lse2)
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w1, w2 = torch.exp(lse1 - shift)[..., None], torch.exp(lse2 - shift)[..., None]
    return w1 * o1.float() + w2 * o2.float(), lse


def full_reference(q, k, v, dout, causal, kpm):
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = sdpa_attention(qr, kr, vr, causal, kpm)
    out.backward(dout.float())
    return out.detach(), lse, qr.grad, kr.grad, vr.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_key_halves_merge_to_full_attention(backend):
    gen = torch.Generator().manual_seed(0)
    b, h, sq, sk, d = 2, 2, 21, 38, 32
    q, dout = randn(gen, b, h, sq, d), randn(gen, b, h, sq, d)
    k, v = randn(gen, b, h, sk, d), randn(gen, b, h, sk, d)
    kpm = random_padding_mask(gen, b, sk, empty_row=True)
    want_out, want_lse, dq_w, dk_w, dv_w = full_reference(q, k, v, dout, False, kpm)

    split = 17
    halves = [(k[:, :, :split], v[:, :, :split], kpm[:, :split]), (k[:, :, split:], v[:, :, split:], kpm[:, split:])]
    blocks = [attention_block_forward(q, kh, vh, key_padding_mask=mh, backend=backend) for kh, vh, mh in halves]
    out, lse = merge(*blocks[0], *blocks[1])
    assert_close(out, want_out, OUT_TOL[torch.float32], scale_atol=False)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert_close(lse[torch.isfinite(lse)], want_lse[torch.isfinite(lse)], (1e-5, 1e-5), scale_atol=False)

    # each block's backward with the global (lse, out) is its exact share of the full gradients
    grads = [attention_block_backward(dout, q, kh, vh, out, lse, key_padding_mask=mh, backend=backend)
             for kh, vh, mh in halves]
    tol = GRAD_TOL[torch.float32]
    assert_close(grads[0][0] + grads[1][0], dq_w, tol)
    assert_close(torch.cat([grads[0][1], grads[1][1]], 2), dk_w, tol)
    assert_close(torch.cat([grads[0][2], grads[1][2]], 2), dv_w, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_ring_of_two_blocks(backend):
    """Causal: query half a sees key half a (diagonal, causal); query half b sees key half a
    (fully, non-causal) and key half b (diagonal, causal)."""
    gen = torch.Generator().manual_seed(1)
    b, h, s, d = 1, 2, 46, 48
    half = s // 2
    q, k, v, dout = (randn(gen, b, h, s, d) for _ in range(4))
    kpm = random_padding_mask(gen, b, s)
    want_out, want_lse, dq_w, dk_w, dv_w = full_reference(q, k, v, dout, True, kpm)
    qa, qb = q[:, :, :half], q[:, :, half:]
    ka, kb, va, vb = k[:, :, :half], k[:, :, half:], v[:, :, :half], v[:, :, half:]
    ma, mb = kpm[:, :half], kpm[:, half:]

    out_a, lse_a = attention_block_forward(qa, ka, va, causal=True, key_padding_mask=ma, backend=backend)
    past = attention_block_forward(qb, ka, va, causal=False, key_padding_mask=ma, backend=backend)
    diag = attention_block_forward(qb, kb, vb, causal=True, key_padding_mask=mb, backend=backend)
    out_b, lse_b = merge(*past, *diag)
    assert_close(torch.cat([out_a.float(), out_b], 2), want_out, OUT_TOL[torch.float32], scale_atol=False)
    lse = torch.cat([lse_a, lse_b], 2)
    assert_close(lse, want_lse, (1e-5, 1e-5), scale_atol=False)

    da, db = dout[:, :, :half], dout[:, :, half:]
    g_aa = attention_block_backward(da, qa, ka, va, out_a, lse_a, causal=True, key_padding_mask=ma, backend=backend)
    g_ba = attention_block_backward(db, qb, ka, va, out_b, lse_b, causal=False, key_padding_mask=ma, backend=backend)
    g_bb = attention_block_backward(db, qb, kb, vb, out_b, lse_b, causal=True, key_padding_mask=mb, backend=backend)
    tol = GRAD_TOL[torch.float32]
    assert_close(torch.cat([g_aa[0], g_ba[0] + g_bb[0]], 2), dq_w, tol)
    assert_close(torch.cat([g_aa[1] + g_ba[1], g_bb[1]], 2), dk_w, tol)
    assert_close(torch.cat([g_aa[2] + g_ba[2], g_bb[2]], 2), dv_w, tol)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_never_builds_the_full_score_matrix(monkeypatch, causal):
    monkeypatch.setattr(flash_attention_ref, "KEY_CHUNK", 16)
    monkeypatch.setattr(flash_attention_ref, "QUERY_CHUNK", 24)
    gen = torch.Generator().manual_seed(2)
    b, h, sq, sk, d = 1, 2, 100, 90, 8
    q, dout = randn(gen, b, h, sq, d), randn(gen, b, h, sq, d)
    k, v = randn(gen, b, h, sk, d), randn(gen, b, h, sk, d)
    kpm = random_padding_mask(gen, b, sk, empty_row=True)
    want_out, want_lse, dq_w, dk_w, dv_w = full_reference(q, k, v, dout, causal, kpm)

    with LargestOutput() as probe:
        out, lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend="torch")
        grads = attention_block_backward(dout, q, k, v, out, lse, causal=causal, key_padding_mask=kpm,
                                         backend="torch")
    # biggest temporaries: one [B, H, 24, 16] score chunk or a full [B, H, S, D] tensor; never [B, H, Sq, Sk]
    assert probe.largest <= max(b * h * 24 * 16, b * h * max(sq, sk) * d) < b * h * sq * sk
    assert_close(out, want_out, OUT_TOL[torch.float32], scale_atol=False)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(lse)
    assert_close(lse[finite], want_lse[finite], (1e-5, 1e-5), scale_atol=False)
    for got, want in zip(grads, (dq_w, dk_w, dv_w)):
        assert_close(got, want, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_enters_the_block_backward(backend, causal):
    """lse_grad = dL/dlse adds P * lse_grad to dS: the block backward equals autograd through
    SDPA's output and an explicit logsumexp (fp64 reference). "auto" on CPU takes the torch
    reference, as torch's fused CPU op computes D = rowsum(dO * O) itself."""
    gen = torch.Generator().manual_seed(4)
    b, h, s, d = 1, 2, 13, 16
    q, k, v, dout = (randn(gen, b, h, s, d) for _ in range(4))
    lse_grad = torch.randn(b, h, s, generator=gen)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) / d**0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out, lse = scores.softmax(-1) @ leaves[2], scores.logsumexp(-1)
    ((out * dout.double()).sum() + (lse * lse_grad.double()).sum()).backward()
    kernel_out, kernel_lse = attention_block_forward(q, k, v, causal=causal, backend="torch")
    grads = attention_block_backward(dout, q, k, v, kernel_out, kernel_lse, causal=causal, backend=backend,
                                     lse_grad=lse_grad)
    for got, want in zip(grads, (t.grad for t in leaves)):
        assert_close(got, want.float(), GRAD_TOL[torch.float32])
    with pytest.raises(ValueError, match="cannot take an lse gradient"):
        attention_block_backward(dout, q, k, v, kernel_out, kernel_lse, backend="aten", lse_grad=lse_grad)
