"""Dropout inside the attention block kernel: the stateless mask (dropout_mask.py), the kernels
against an explicit dense computation with the same mask, and Triton vs reference masks."""
import pytest
import torch

from shardzoo.kernels import attention_block_backward, attention_block_forward, flash_attention
from shardzoo.kernels.dropout_mask import FMIX_C1, MASK32, dense_keep_mask, fmix32
from shardzoo.testing.kernels import (DEVICE, GRAD_TOL, OUT_TOL, LargestOutput, assert_close, needs_triton, random_padding_mask, randn,
                                      visible_mask)

BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]
P, SEED = 0.3, 2**40 + 12345  # a seed above 2^32 exercises both seed words


def dense_attention(q, k, v, keep, p, causal, kpm):
    """softmax(scale q k^T) * keep / (1-p) @ v in fp32 with autograd; rows without keys give 0."""
    scale = q.shape[-1] ** -0.5
    visible = visible_mask(q.shape[0], q.shape[2], k.shape[2], causal, kpm, q.device)
    scores = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs * keep / (1 - p)) @ v.float()


def test_fmix32_matches_python_integers():
    """The 16-bit split multiply of the torch hash equals exact 32-bit wraparound."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 2**32, (64,), generator=gen)
    got = fmix32(values)
    for x, y in zip(values.tolist(), got.tolist()):
        h = x ^ (x >> 16)
        h = (h * FMIX_C1) & MASK32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & MASK32
        assert y == h ^ (h >> 16)


def test_mask_is_independent_of_sharding_and_has_rate_p():
    """A block with offsets and position subsets draws the matching slice of the full mask."""
    pos = torch.arange(96)
    full = dense_keep_mask(P, SEED, 4, 6, pos, pos)
    rows, cols = torch.tensor([5, 80, 81, 3]), torch.arange(40, 72)
    block = dense_keep_mask(P, SEED, 2, 3, rows, cols, batch_offset=1, head_offset=2)
    assert torch.equal(block, full[1:3, 2:5][:, :, rows][:, :, :, cols])
    assert abs(full.float().mean().item() - (1 - P)) < 0.01
    assert not torch.equal(full, dense_keep_mask(P, SEED + 1, 4, 6, pos, pos))
    assert not torch.equal(full[0, 0], full[0, 1]) and not torch.equal(full[0, 0], full[1, 0])
    assert dense_keep_mask(0.0, SEED, 1, 1, pos, pos).all()


def make_inputs(seed, b=2, h=2, sq=23, sk=37, d=32, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, dout = randn(gen, b, h, sq, d, dtype=dtype), randn(gen, b, h, sq, d, dtype=dtype)
    k, v = randn(gen, b, h, sk, d, dtype=dtype), randn(gen, b, h, sk, d, dtype=dtype)
    return q, k, v, dout, random_padding_mask(gen, b, sk, empty_row=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_kernel_matches_dense_computation(backend, causal):
    """Forward, lse and the block backward (via flash_attention) vs dense autograd, same mask."""
    q, k, v, dout, kpm = make_inputs(1)
    qp = torch.arange(7, 7 + q.shape[2], device=DEVICE) * 3  # any global positions
    kp = torch.arange(k.shape[2], device=DEVICE) + 50
    drop = dict(dropout_p=P, dropout_seed=SEED, q_positions=qp, k_positions=kp, head_offset=3, batch_offset=1)
    keep = dense_keep_mask(P, SEED, 2, 2, qp, kp, batch_offset=1, head_offset=3)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = dense_attention(qr, kr, vr, keep, P, causal, kpm)
    want.backward(dout.float())
    _, undropped_lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend="torch")

    out, lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend=backend, **drop)
    assert_close(out, want, OUT_TOL[torch.float32], scale_atol=False)
    assert torch.equal(lse.isneginf(), undropped_lse.isneginf())  # lse is the undropped normaliser
    finite = lse.isfinite()
    assert_close(lse[finite], undropped_lse[finite], (1e-5, 1e-5), scale_atol=False)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal=causal, key_padding_mask=kpm, backend=backend, **drop).backward(dout)
    for name, got, expected in zip(("dq", "dk", "dv"), (t.grad for t in leaves), (qr.grad, kr.grad, vr.grad)):
        assert_close(got, expected, GRAD_TOL[torch.float32], msg=f"{name} with dropout vs dense autograd")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_draws_the_reference_mask(dtype):
    """With v = I the forward output shows the kept entries, with dout = I the dK/dV kernel's dV
    does: both must be exactly the reference mask. Then all of out, lse, dq, dk, dv agree."""
    b, h, n = 2, 2, 32
    qp, kp = torch.arange(n, device=DEVICE) + 1000, torch.arange(n, device=DEVICE) * 7
    drop = dict(dropout_p=P, dropout_seed=SEED, q_positions=qp, k_positions=kp, head_offset=5, batch_offset=2)
    keep = dense_keep_mask(P, SEED, b, h, qp, kp, batch_offset=2, head_offset=5)
    q, k, _, _, _ = make_inputs(2, b, h, n, n, n, dtype)
    eye = torch.eye(n, dtype=dtype, device=DEVICE).expand(b, h, n, n)
    out, lse = attention_block_forward(q, k, eye, backend="triton", **drop)
    assert torch.equal(out != 0, keep)
    _, _, dv = attention_block_backward(eye, q, k, eye, out, lse, backend="triton", **drop)
    assert torch.equal(dv != 0, keep.transpose(-1, -2))

    q, k, v, dout, kpm = make_inputs(3, dtype=dtype)  # ragged lengths, default positions
    drop = dict(dropout_p=P, dropout_seed=SEED, head_offset=1)
    common = dict(causal=True, key_padding_mask=kpm, **drop)
    got = attention_block_forward(q, k, v, backend="triton", **common)
    ref = attention_block_forward(q, k, v, backend="torch", **common)
    assert_close(got[0], ref[0], OUT_TOL[dtype], scale_atol=False)
    assert torch.equal(got[1].isneginf(), ref[1].isneginf())
    grads = [attention_block_backward(dout, q, k, v, *ref, backend=be, **common) for be in ("triton", "torch")]
    for name, a, e in zip(("dq", "dk", "dv"), *grads):
        assert_close(a, e, GRAD_TOL[torch.float32], msg=f"{name}: triton vs torch with dropout")


def test_flash_attention_draws_its_seed_from_torch():
    q, k, v, _, kpm = make_inputs(4)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(flash_attention(q, k, v, key_padding_mask=kpm, dropout_p=P))
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], flash_attention(q, k, v, key_padding_mask=kpm))


def test_reference_with_dropout_never_builds_the_full_score_matrix(monkeypatch):
    from shardzoo.kernels import flash_attention_ref

    monkeypatch.setattr(flash_attention_ref, "KEY_CHUNK", 16)
    monkeypatch.setattr(flash_attention_ref, "QUERY_CHUNK", 24)
    q, k, v, dout, kpm = make_inputs(5, b=1, sq=100, sk=90, d=8)
    drop = dict(dropout_p=P, dropout_seed=SEED, causal=True, key_padding_mask=kpm, backend="torch")
    with LargestOutput() as probe:
        out, lse = attention_block_forward(q, k, v, **drop)
        attention_block_backward(dout, q, k, v, out, lse, **drop)
    # one [B, H, 24, 16] chunk (scores, mask, hashes) or a [B, H, S, D] tensor; never [B, H, Sq, Sk]
    assert probe.largest <= max(2 * 24 * 16, 2 * 100 * 8) < 2 * 100 * 90
