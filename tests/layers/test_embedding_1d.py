"""VocabParallelEmbedding1D and Embedding1D against nn.Embedding: init, output, weight gradient,
vocabularies not divisible by tp (padding rows invisible), padding_idx, sequence parallelism."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers.embedding_1d import Embedding1D, VocabParallelEmbedding1D
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close, cached_mesh, dtypes, run_on_ranks

DTYPES = dtypes("fp32", "fp64")


def check_embedding(case):
    dtype = DTYPES[case["dtype"]]
    tp = case["tp"]
    mesh = cached_mesh(tp=tp)
    vocab, hidden, pad = case["vocab"], case["hidden"], case["padding_idx"]
    torch.manual_seed(case["seed"])
    serial = nn.Embedding(vocab, hidden, padding_idx=pad, dtype=dtype)
    torch.manual_seed(case["seed"])
    if case["kind"] == "vocab":
        kwargs = {"sequence_parallel": case["sp"]}
        cls = VocabParallelEmbedding1D
    else:
        kwargs, cls = {}, Embedding1D
    par = cls.from_serial(serial, mesh, **kwargs) if case["from_serial"] else cls(
        vocab, hidden, pad, mesh=mesh, dtype=dtype, **kwargs)
    assert par.mesh is mesh and get_shard_spec(par, "weight") is not None
    state = full_state_dict(par)
    assert state["weight"].shape == (vocab, hidden)
    assert torch.equal(state["weight"], serial.weight.detach()), "init differs from nn.Embedding's"

    gen = torch.Generator().manual_seed(case["seed"] + 1)
    ids = torch.randint(0, vocab, (case["batch"], case["seq"]), generator=gen)
    if pad is not None:
        ids[0, 0] = pad % vocab
    gy = torch.randn(case["batch"], case["seq"], hidden, generator=gen, dtype=torch.float64).to(dtype)
    y_ref = serial(ids)
    y_ref.backward(gy)
    y = par.gather_output(par(par.shard_input(ids)))
    y.backward(gy)
    tol = dict(terms=case["batch"] * case["seq"], parts=tp)  # a row's gradient sums over the tokens
    assert_close(y, y_ref.detach(), "output", **tol)
    assert_close(gather_full(par.weight.grad, get_shard_spec(par, "weight"), mesh), serial.weight.grad,
                 "weight grad", **tol)
    spec = get_shard_spec(par, "weight")
    padding_rows = par.weight[spec.valid_local()[0].stop:]
    assert not padding_rows.any() and not par.weight.grad[spec.valid_local()[0].stop:].any()
    return tuple(y.shape)


@st.composite
def embedding_case(draw, tp):
    kind = draw(st.sampled_from(["vocab", "hidden"]))
    vocab = draw(st.integers(1, 23))
    sp = kind == "vocab" and draw(st.booleans())
    return {
        "tp": tp, "kind": kind, "vocab": vocab, "sp": sp,
        "hidden": draw(st.integers(1, 3)) * (tp if kind == "hidden" else 1) + (0 if kind == "hidden" else 1),
        "padding_idx": draw(st.one_of(st.none(), st.integers(-vocab, vocab - 1))),
        "batch": draw(st.integers(1, 2)), "seq": draw(st.integers(1, 3)) * (tp if sp else 1),
        "dtype": draw(st.sampled_from(list(DTYPES))), "seed": draw(st.integers(0, 2**31)),
        "from_serial": draw(st.booleans()),
    }  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=10)
@given(data=st.data())
def test_embedding_matches_serial(tp, data):
    case = data.draw(embedding_case(tp))
    run_on_ranks(check_embedding, tp, case)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt2_vocab_fixed_example(tp, sp):
    """GPT-2's 50257 rows over any tp: 50257 = 8 * 6283 - 7, so the last rank has 7 padding rows."""
    case = {"tp": tp, "kind": "vocab", "vocab": 50257, "sp": sp, "hidden": 8, "padding_idx": None, "batch": 2,
            "seq": 16, "dtype": "fp32", "seed": 11, "from_serial": False}
    run_on_ranks(check_embedding, tp, case)


def hidden_divisibility_error():
    try:
        Embedding1D(10, 6, mesh=cached_mesh(tp=4))
    except ValueError as e:
        return str(e)
    return None


def test_embedding1d_indivisible_hidden_raises_clear_error():
    for msg in run_on_ranks(hidden_divisibility_error, 4):
        assert msg is not None and "Embedding1D needs embedding_dim divisible by tp=4; got embedding_dim=6" in msg
