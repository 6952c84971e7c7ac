"""Cross-entropy partials / gradient: Triton (interpreter on CPU) vs torch reference vs
F.cross_entropy, including a simulated vocab-parallel split."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.kernels import cross_entropy, cross_entropy_grad, cross_entropy_partials
from shardzoo.testing.kernels import DEVICE, DTYPES, GRAD_TOL, OUT_TOL, assert_close, needs_triton, randn

BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]
F32 = OUT_TOL[torch.float32]


def make_batch(seed, n, vocab, dtype, ignored=0.2):
    gen = torch.Generator().manual_seed(seed)
    logits = randn(gen, n, vocab, dtype=dtype, scale=3.0)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[torch.rand(n, generator=gen) < ignored] = -100
    return logits, target.to(DEVICE)


def split_vocab_loss(logits, target, shards, label_smoothing, backend):
    """Vocab-parallel loss as the layers/ module would compute it, shards simulated in one process."""
    vocab = logits.shape[1]
    bounds = torch.linspace(0, vocab, shards + 1).long().tolist()
    parts = [cross_entropy_partials(logits[:, a:b], target, a, backend) for a, b in zip(bounds, bounds[1:])]
    row_max = torch.stack([p[0] for p in parts]).amax(0)  # all-reduce max
    sum_exp = sum(p[1] * torch.exp(p[0] - row_max) for p in parts)  # all-reduce sum after rescaling
    target_logit = sum(p[2] for p in parts)
    sum_logits = sum(p[3] for p in parts)
    lse = row_max + torch.log(sum_exp)
    valid = target >= 0
    loss = lse - (1 - label_smoothing) * target_logit - label_smoothing * sum_logits / vocab
    loss = torch.where(valid, loss, torch.zeros_like(loss)).sum() / valid.sum()
    grad_row = valid.float() / valid.sum()
    grads = [cross_entropy_grad(logits[:, a:b], target, a, lse, grad_row, label_smoothing, vocab, backend)
             for a, b in zip(bounds, bounds[1:])]
    return loss, torch.cat(grads, 1), (row_max, sum_exp, lse)


def check_split(backend, n, vocab, shards, dtype, label_smoothing, seed):
    logits, target = make_batch(seed, n, vocab, dtype)
    target[0] = vocab - 1  # a target in the last shard
    lr = logits.detach().float().requires_grad_()
    want = F.cross_entropy(lr, target, ignore_index=-100, label_smoothing=label_smoothing)
    want.backward()
    loss, grad, (row_max, sum_exp, lse) = split_vocab_loss(logits, target, shards, label_smoothing, backend)
    assert_close(loss, want, F32, scale_atol=False)
    assert_close(lse, torch.logsumexp(logits.float(), -1), F32, scale_atol=False)
    assert grad.dtype == dtype
    assert_close(grad, lr.grad, GRAD_TOL[dtype])


cases = dict(
    n=st.integers(1, 12), vocab=st.integers(3, 700), shards=st.integers(1, 3), dtype=st.sampled_from(DTYPES),
    label_smoothing=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 999),
)


@needs_triton
@settings(max_examples=15, deadline=None)
@given(**cases)
def test_triton_vocab_parallel_loss(n, vocab, shards, dtype, label_smoothing, seed):
    check_split("triton", n, vocab, shards, dtype, label_smoothing, seed)


@settings(max_examples=30, deadline=None)
@given(**cases)
def test_reference_vocab_parallel_loss(n, vocab, shards, dtype, label_smoothing, seed):
    check_split("torch", n, vocab, shards, dtype, label_smoothing, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_partials_against_torch(backend, dtype):
    logits, _ = make_batch(0, 7, 1000, dtype)
    target = torch.tensor([-100, -1, 0, 299, 300, 1299, 1300], device=DEVICE)  # vocab_start=300, V_local=1000
    row_max, sum_exp, target_logit, sum_logits = cross_entropy_partials(logits, target, 300, backend)
    x = logits.float()
    for t in (row_max, sum_exp, target_logit, sum_logits):
        assert t.dtype == torch.float32 and t.shape == (7,)
    assert torch.equal(row_max, x.amax(-1))
    assert_close(sum_exp, torch.exp(x - x.amax(-1, keepdim=True)).sum(-1), F32, scale_atol=False)
    assert_close(sum_logits, x.sum(-1), (1e-4, 1e-5), scale_atol=False)
    want_target = torch.zeros(7, device=DEVICE)
    want_target[4], want_target[5] = x[4, 0], x[5, 999]
    assert torch.equal(target_logit, want_target)
    if backend == "triton":
        ref = cross_entropy_partials(logits, target, 300, "torch")
        for got, want in zip((row_max, sum_exp, target_logit, sum_logits), ref):
            assert_close(got, want, (1e-4, 1e-5), scale_atol=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_zero_for_ignored_rows_and_matches_reference(backend):
    logits, target = make_batch(1, 6, 300, torch.float32, ignored=0.0)
    target[1] = -100
    lse = torch.logsumexp(logits, -1)
    lse[1] = float("nan")  # whatever an ignored row carries, its gradient is 0
    grad_row = torch.linspace(0.5, 1.5, 6, device=DEVICE)
    got = cross_entropy_grad(logits, target, 50, lse, grad_row, 0.1, 500, backend)
    want = cross_entropy_grad(logits, target, 50, lse, grad_row, 0.1, 500, "torch")
    assert (got[1] == 0).all() and torch.isfinite(got).all()
    assert_close(got, want, GRAD_TOL[torch.float32])
    p = torch.softmax(logits, -1) - 0.1 / 500  # check one row by hand
    local = target[0] - 50
    if 0 <= local < 300:
        p[0, local] -= 0.9
    assert_close(got[0], p[0] * grad_row[0], GRAD_TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_serial_cross_entropy_equals_torch(backend, reduction, label_smoothing, dtype):
    logits, target = make_batch(3, 10, 257, dtype)
    target = target.reshape(2, 5)
    logits = logits.reshape(2, 5, 257)
    lr = logits.detach().float().requires_grad_()
    want = F.cross_entropy(lr.reshape(10, 257), target.reshape(10), ignore_index=-100,
                           label_smoothing=label_smoothing, reduction=reduction)
    want = want.reshape(2, 5) if reduction == "none" else want
    la = logits.detach().clone().requires_grad_()
    got = cross_entropy(la, target, ignore_index=-100, label_smoothing=label_smoothing, reduction=reduction,
                        backend=backend)
    assert got.shape == want.shape and got.dtype == dtype
    assert_close(got, want, OUT_TOL[dtype], scale_atol=False)
    upstream = torch.rand(want.shape, device=DEVICE) if reduction == "none" else torch.tensor(1.7, device=DEVICE)
    want.backward(upstream)
    got.backward(upstream.to(dtype))
    assert_close(la.grad, lr.grad, GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_vocab_fixed_case(backend):
    check_split(backend, 4, 50304 // 8, 2, torch.bfloat16, 0.1, seed=9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_without_vocab_columns(backend):
    logits = torch.zeros(3, 0, device=DEVICE)
    target = torch.tensor([0, 5, -100], device=DEVICE)
    row_max, sum_exp, target_logit, sum_logits = cross_entropy_partials(logits, target, 10, backend)
    assert torch.isneginf(row_max).all()
    assert (sum_exp == 0).all() and (target_logit == 0).all() and (sum_logits == 0).all()
    grad = cross_entropy_grad(logits, target, 10, torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE),
                              vocab_size=20, backend=backend)
    assert grad.shape == (3, 0)


def test_float64_serial_loss_on_torch_backend():
    logits, target = make_batch(5, 6, 30, torch.float64)
    lr = logits.detach().clone().requires_grad_()
    want = F.cross_entropy(lr, target, label_smoothing=0.1)
    want.backward()
    la = logits.detach().clone().requires_grad_()
    got = cross_entropy(la, target, label_smoothing=0.1, backend="torch")
    got.backward()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(la.grad, lr.grad, atol=1e-12, rtol=1e-12)


def test_ignore_index_can_be_non_negative():
    logits, _ = make_batch(4, 8, 20, torch.float32)
    target = torch.tensor([0, 3, 5, 3, 19, 3, 2, 1], device=DEVICE)
    got = cross_entropy(logits, target, ignore_index=3)
    assert_close(got, F.cross_entropy(logits, target, ignore_index=3), F32, scale_atol=False)


def test_cross_entropy_errors():
    logits = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="target value 10 is outside"):
        cross_entropy(logits, torch.tensor([1, 2, 10, 3], device=DEVICE))
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(logits, torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="reduction='avg'"):
        cross_entropy(logits, torch.tensor([1, 2, 3, 4], device=DEVICE), reduction="avg")
    with pytest.raises(ValueError, match="target.dtype=torch.float32"):
        cross_entropy_partials(logits, torch.zeros(4, device=DEVICE), 0)
    with pytest.raises(ValueError, match="vocab_size=5 is smaller"):
        cross_entropy_grad(logits, torch.zeros(4, dtype=torch.long, device=DEVICE), 0, torch.zeros(4, device=DEVICE),
                           torch.ones(4, device=DEVICE), vocab_size=5)
