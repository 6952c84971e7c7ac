"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits: loss and logits
gradient, every reduction, ignore_index, label smoothing, vocabularies not divisible by the
group size (padding columns filled with large junk that must be ignored), any process group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.layers.cross_entropy import vocab_parallel_cross_entropy
from shardzoo.testing import assert_close_conditioned, cached_mesh, dtypes, run_on_ranks

DTYPES = dtypes("fp32", "fp64")


def check_cross_entropy(case, group_axes=None):
    """Vocab split over ``group_axes`` of a cached mesh (None: the whole world)."""
    dtype = DTYPES[case["dtype"]]
    if group_axes is None:
        group = dist.group.WORLD
    else:
        group = cached_mesh(**case["layout"]).group(*group_axes)
    p, r = dist.get_world_size(group), dist.get_rank(group)
    shape, vocab = case["shape"], case["vocab"]
    gen = torch.Generator().manual_seed(case["seed"])
    logits = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * case["scale"]).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    ignore = case["ignore_index"]
    target = torch.where(torch.rand(shape, generator=gen) < case["p_ignore"], torch.full_like(target, ignore), target)
    grad_out = torch.randn(shape if case["reduction"] == "none" else (), generator=gen, dtype=torch.float64).to(dtype)

    kwargs = dict(ignore_index=ignore, label_smoothing=case["smoothing"], reduction=case["reduction"])

    def serial(in_dtype):
        """F.cross_entropy on the full logits (the same rounded values) in ``in_dtype``: loss, logits grad."""
        full = logits.detach().to(in_dtype).clone().requires_grad_(True)
        ref = F.cross_entropy(full.flatten(0, -2), target.flatten(), **kwargs)
        ref = ref.reshape(shape) if case["reduction"] == "none" else ref
        ref.backward(grad_out.to(in_dtype))
        return ref.detach(), full.grad

    ref, ref_grad = serial(dtype)
    exact, exact_grad = serial(torch.float64)  # how far the serial run itself is from exact
    gauge, gauge_grad = serial(torch.float32) if dtype == torch.float64 else (None, None)

    per_rank = -(-vocab // p)
    padded = torch.cat([logits, torch.full((*shape, per_rank * p - vocab), 50.0, dtype=dtype)], -1)
    local = padded[..., r * per_rank:(r + 1) * per_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, group=group, vocab_start=r * per_rank, vocab_size=vocab,
                                        **kwargs)
    loss.backward(grad_out)
    assert loss.dtype == dtype and loss.shape == ref.shape
    if case["reduction"] == "mean" and not bool((target != ignore).any()):
        assert torch.isnan(loss) and torch.isnan(ref), "mean over zero counted targets is nan, as in torch"
        return float("nan")
    # The softmax sums over the vocabulary, the mean over the tokens. A loss near 0 is the
    # difference of a log-sum-exp and a target logit, each of the logits' size; a gradient element
    # near 0 is the difference of a probability and a target weight, each up to |grad_out| / count.
    # exp turns an absolute error of a logit into a relative error of its probability
    tol = dict(terms=vocab + target.numel(), parts=p, condition=1 + float(logits.abs().max()))
    count = int((target != ignore).sum()) if case["reduction"] == "mean" else 1
    assert_close_conditioned(loss, ref, exact, "loss", floor=float(logits.abs().max()), gauge=gauge, **tol)

    def padded_block(grad):
        return torch.cat([grad, torch.zeros(*shape, per_rank * p - vocab, dtype=grad.dtype)], -1)[
            ..., r * per_rank:(r + 1) * per_rank]

    assert_close_conditioned(local.grad, padded_block(ref_grad), padded_block(exact_grad), "logits grad",
                             floor=float(grad_out.abs().max()) / max(count, 1),
                             gauge=None if gauge_grad is None else padded_block(gauge_grad), **tol)
    return float(loss.detach().sum())


@st.composite
def ce_case(draw):
    ndim = draw(st.integers(1, 2))
    return {
        "shape": [draw(st.integers(1, 4)) for _ in range(ndim)], "vocab": draw(st.integers(1, 19)),
        "dtype": draw(st.sampled_from(list(DTYPES))), "seed": draw(st.integers(0, 2**31)),
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "ignore_index": draw(st.sampled_from([-100, -1, 0])), "p_ignore": draw(st.sampled_from([0.0, 0.3])),
        "smoothing": draw(st.sampled_from([0.0, 0.1, 0.7])), "scale": draw(st.sampled_from([1.0, 30.0])),
    }  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@settings(max_examples=12)
@given(case=ce_case())
def test_matches_f_cross_entropy(world, case):
    losses = run_on_ranks(check_cross_entropy, world, case)
    assert len({str(v) for v in losses}) == 1, "every rank must return the same loss"


def test_gpt2_vocab_fixed_example_8_ranks():
    """50257 over 8 ranks: 6283 columns per rank, the last rank holds 7 padding columns."""
    case = {"shape": [2, 3], "vocab": 50257, "dtype": "fp32", "seed": 3, "reduction": "mean",
            "ignore_index": -100, "p_ignore": 0.2, "smoothing": 0.1, "scale": 3.0}
    run_on_ranks(check_cross_entropy, 8, case)


def test_vocab_split_over_a_sub_group():
    """Generic over groups: the vocab split over the "tp" axis of a dp=2 x tp=2 mesh."""
    case = {"shape": [3, 2], "vocab": 7, "dtype": "fp64", "seed": 5, "reduction": "none", "ignore_index": -100,
            "p_ignore": 0.2, "smoothing": 0.2, "scale": 1.0, "layout": {"dp": 2, "tp": 2}}
    run_on_ranks(check_cross_entropy, 4, case, ("tp",))


def test_rank_holding_only_padding():
    """vocab 5 over 4 ranks: 2 columns each, rank 3 holds padding only."""
    case = {"shape": [4], "vocab": 5, "dtype": "fp64", "seed": 9, "reduction": "sum", "ignore_index": -100,
            "p_ignore": 0.0, "smoothing": 0.3, "scale": 1.0}
    run_on_ranks(check_cross_entropy, 4, case)


def test_bad_target_raises_clear_error():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"target id 7 is outside \[0, 5\) and is not ignore_index=-100"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 7, 2]), group=None, vocab_start=0, vocab_size=5)
    with pytest.raises(ValueError, match="reduction='avg' is not one of"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 2, 2]), group=None, vocab_start=0, vocab_size=5,
                                     reduction="avg")
