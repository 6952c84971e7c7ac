"""LMHead1D (+ its vocab-parallel loss) against nn.Linear + F.cross_entropy, untied and
tied to a VocabParallelEmbedding1D, vocab sizes not divisible by tp, gather_output, sequence
parallelism; Classifier1D tied to each kind of 1D table."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers.embedding_1d import VocabParallelEmbedding1D
from shardzoo.layers.head_1d import Classifier1D, LMHead1D
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close, cached_mesh, dtypes, rms_of, run_on_ranks
from support.tied_classifier import check_checkpoint_round_trip, check_tied_classifier

DTYPES = dtypes("fp32", "fp64")


def check_head(case):
    dtype = DTYPES[case["dtype"]]
    tp = case["tp"]
    mesh = cached_mesh(tp=tp)
    vocab, hidden, b, s = case["vocab"], case["hidden"], case["batch"], case["seq"]
    kwargs = dict(gather_output=case["gather"], sequence_parallel=case["sp"])
    torch.manual_seed(case["seed"])
    if case["tied"]:
        serial_emb = nn.Embedding(vocab, hidden, dtype=dtype)
        serial_weight = serial_emb.weight
        emb = VocabParallelEmbedding1D.from_serial(serial_emb, mesh)
        head = LMHead1D(hidden, vocab, mesh=mesh, tie_to=emb, **kwargs)
        assert head.weight is emb.weight
        serial_logits = lambda x: F.linear(x, serial_weight)  # noqa: E731
    else:
        serial = nn.Linear(hidden, vocab, case["bias"], dtype=dtype)
        torch.manual_seed(case["seed"])
        head = LMHead1D(hidden, vocab, case["bias"], mesh=mesh, dtype=dtype, **kwargs)
        state = full_state_dict(head)
        for k, v in serial.state_dict().items():
            assert torch.equal(state[k], v), f"init of {k} differs from nn.Linear's"
        serial_weight, serial_logits = serial.weight, serial

    gen = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(b, s, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (b, s), generator=gen)
    if b * s > 1:
        target[0, 0] = -100  # ignored position
    ce = dict(label_smoothing=case["smoothing"], reduction="mean")
    logits_ref = serial_logits(x)
    logits_ref.retain_grad()
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), target.flatten(), **ce)
    loss_ref.backward()
    # the input gradient sums (p - onehot) W over the vocabulary, which cancels (p - onehot sums
    # to 0), and the weight and bias gradients sum over tokens of either sign: their rounding is of
    # the size of the summands (|dlogits| @ |W|, |dlogits|^T @ |x|, sum |dlogits|), not of the result
    dlogits = logits_ref.grad.detach().abs().flatten(0, 1)
    input_floor = rms_of([dlogits @ serial_weight.detach().abs()])
    weight_floor = rms_of([dlogits.T @ x.detach().abs().flatten(0, 1)])
    bias_floor = rms_of([dlogits.sum(0)])

    x_par = x.detach().clone().requires_grad_(True)
    logits = head(head.shard_input(x_par))
    per_rank = -(-vocab // tp)
    assert logits.shape[-1] == (vocab if case["gather"] else per_rank)
    tol = dict(terms=hidden + vocab + b * s, parts=tp)  # logits over hidden, loss over vocab, grads over tokens
    assert_close(head.gather_output(logits), logits_ref.detach(), "logits", **tol)
    assert head.shard_target(target) is target  # 1D: the logits hold every position
    loss = head.loss(logits, head.shard_target(target), **ce)
    loss.backward()
    assert_close(loss, loss_ref.detach(), "loss", **tol)
    assert_close(x_par.grad, x.grad, "input grad", floor=input_floor, **tol)
    assert_close(gather_full(head.weight.grad, get_shard_spec(head, "weight"), mesh), serial_weight.grad,
                 "weight grad", floor=weight_floor, **tol)
    if head.bias is not None:
        assert_close(gather_full(head.bias.grad, get_shard_spec(head, "bias"), mesh), serial.bias.grad, "bias grad",
                     floor=bias_floor, **tol)
    return float(loss.detach())


@st.composite
def head_case(draw, tp):
    sp = draw(st.booleans())
    tied = draw(st.booleans())
    return {
        "tp": tp, "vocab": draw(st.integers(2, 21)), "hidden": draw(st.integers(1, 6)), "sp": sp, "tied": tied,
        "bias": not tied and draw(st.booleans()), "gather": draw(st.booleans()),
        "batch": draw(st.integers(1, 2)), "seq": draw(st.integers(1, 3)) * (tp if sp else 1),
        "smoothing": draw(st.sampled_from([0.0, 0.1])),
        "dtype": draw(st.sampled_from(list(DTYPES))), "seed": draw(st.integers(0, 2**31)),
    }  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=10)
@given(data=st.data())
def test_head_and_loss_match_serial(tp, data):
    case = data.draw(head_case(tp))
    losses = run_on_ranks(check_head, tp, case)
    assert len(set(losses)) == 1


@pytest.mark.parametrize("tied", [False, True])
def test_gpt2_vocab_fixed_example_8_ranks(tied):
    case = {"tp": 8, "vocab": 50257, "hidden": 16, "sp": True, "tied": tied, "bias": not tied, "gather": False,
            "batch": 1, "seq": 8, "smoothing": 0.1, "dtype": "fp32", "seed": 5}
    run_on_ranks(check_head, 8, case)


def test_tie_with_mismatched_sizes_raises_clear_error():
    run_on_ranks(tie_mismatch, 2)


def tie_mismatch():
    mesh = cached_mesh(tp=2)
    emb = VocabParallelEmbedding1D(11, 4, mesh=mesh)
    with pytest.raises(ValueError, match="cannot tie to an embedding of num_embeddings=11, embedding_dim=4"):
        LMHead1D(4, 12, mesh=mesh, tie_to=emb)
    with pytest.raises(ValueError, match="has no bias; pass bias=False"):
        LMHead1D(4, 11, True, mesh=mesh, tie_to=emb)


# -- Classifier1D tied to an embedding's table ----------------------------------------------
def check_tied_classifier_1d(tp, table, case):
    return check_tied_classifier(cached_mesh(tp=tp), table, case)


def tied_case(draw, tp):
    """Any classes (a vocabulary-parallel table pads them to a multiple of tp), hidden a
    multiple of tp (Embedding1D splits it)."""
    return {"hidden": tp * draw(st.integers(1, 3)), "classes": draw(st.integers(1, 9)), "batch": draw(st.integers(1, 2)),
            "seq": draw(st.integers(1, 3)), "bias": draw(st.booleans()), "dtype": draw(st.sampled_from(list(DTYPES))),
            "seed": draw(st.integers(0, 2**31)), "factory": draw(st.booleans())}


@pytest.mark.parametrize("table", ["embedding", "Embedding1D", "vocab_embedding"])
@pytest.mark.parametrize("tp", [2, 4])
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_classifier_tied_to_a_table_matches_serial(tp, table, data):
    """Forward, dx and the shared table's gradient against nn.Embedding + nn.Linear sharing
    the table; the table saved once. "embedding" is the 1D layout's replicated nn.Embedding."""
    case = tied_case(data.draw, tp)
    shapes = run_on_ranks(check_tied_classifier_1d, tp, tp, table, case)
    assert shapes[0] == (case["batch"], case["seq"], case["classes"])


def classifier_tie_errors():
    mesh = cached_mesh(tp=2)
    emb = VocabParallelEmbedding1D(11, 4, mesh=mesh)
    with pytest.raises(ValueError, match=r"Classifier1D\(in_features=4, num_classes=12\) cannot tie to .*"
                                         r"with embedding_dim=in_features, num_embeddings=num_classes"):
        Classifier1D(4, 12, mesh=mesh, tie_to=emb)
    with pytest.raises(ValueError, match="cannot tie to Linear"):
        Classifier1D(4, 11, mesh=mesh, tie_to=nn.Linear(4, 11))
    with pytest.raises(ValueError, match="must use the embedding's mesh; pass mesh=embedding.mesh"):
        Classifier1D(4, 11, mesh=cached_mesh(dp=2, tp=1), tie_to=emb)


def test_classifier_tie_errors():
    run_on_ranks(classifier_tie_errors, 2)


def tied_checkpoint_1d(table, case, ckpt_dir):
    return check_checkpoint_round_trip(cached_mesh(tp=4), table, case, ckpt_dir)


@pytest.mark.parametrize("table", ["Embedding1D", "vocab_embedding"])
def test_tied_classifier_checkpoint_holds_the_table_once(table, tmp_path):
    case = dict(hidden=4, classes=7, bias=True, dtype="fp32", seed=3, factory=False)
    run_on_ranks(tied_checkpoint_1d, 4, table, case, str(tmp_path / "ckpt"))
