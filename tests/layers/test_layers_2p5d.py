"""2.5D (Tesseract) layers against their serial twins at tp=8 (q=2, d=2) and tp=4 (d=1, where
2.5D must behave as 2D: same results and the same communication). Harness: test_layouts.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.testing import run_on_ranks
from grid_chaining import check_mlp_training
from test_layouts import (check_default_init, check_linear, check_lm, check_module, check_patch, construction_error,
                          linear_case, lm_case, mlp_case, module_case, patch_case, world_of)


@pytest.mark.parametrize("name", ["2.5d", "2.5d_d1"])
@given(data=st.data())
@settings(max_examples=12)
def test_linear_2p5d_matches_serial(name, data):
    case = linear_case(data.draw, name)
    shapes = run_on_ranks(check_linear, world_of(name), case)
    assert shapes[0] == (case["batch"], case["seq"], case["out"])


def test_linear_2p5d_fixed_largest():
    case = dict(name="2.5d", **{"in": 64}, out=96, batch=8, seq=16, bias=True, dtype="fp32", seed=11, from_serial=False)
    run_on_ranks(check_linear, 8, case)


@pytest.mark.parametrize("args", [(7, 4), (4, 7)])
def test_linear_2p5d_divisibility_error(args):
    what = "in_features" if args[0] == 7 else "out_features"
    for m in run_on_ranks(construction_error, 8, "2.5d", "linear", args, {}):
        assert m is not None and f"ParallelLinear2p5D needs {what} divisible by q=2; got 7" in m


def test_linear_2p5d_rejects_a_2d_mesh():
    for m in run_on_ranks(construction_error, 4, "2d", "linear_2p5d", (4, 4), {}):
        assert m is not None and "ParallelLinear2p5D needs a ParallelMesh with tp_mode='2.5d'" in m


KINDS = ["norm", "embedding", "vocab_embedding", "classifier"]


@pytest.mark.parametrize("name", ["2.5d", "2.5d_d1"])
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
@settings(max_examples=5)
def test_module_2p5d_matches_serial(name, kind, data):
    run_on_ranks(check_module, world_of(name), module_case(data.draw, name, kind))


@pytest.mark.parametrize("name", ["2.5d", "2.5d_d1"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@given(data=st.data())
@settings(max_examples=2)
def test_lm_head_2p5d_with_cross_entropy(name, reduction, data):
    run_on_ranks(check_lm, world_of(name), lm_case(data.draw, name, reduction))


@given(data=st.data())
@settings(max_examples=5)
def test_patch_embedding_2p5d_matches_vit(data):
    run_on_ranks(check_patch, 8, patch_case(data.draw, "2.5d"))


@pytest.mark.parametrize("name", ["2.5d", "2.5d_d1"])
@given(data=st.data())
@settings(max_examples=4)
def test_mlp_block_2p5d_three_adamw_steps(name, data):
    run_on_ranks(check_mlp_training, world_of(name), mlp_case(data.draw, name))


def test_mlp_block_2p5d_fixed_largest():
    run_on_ranks(check_mlp_training, 8, dict(name="2.5d", hidden=32, ffn=128, batch=8, seq=8, dtype="fp32", seed=3))


@pytest.mark.parametrize("kind,args", [("norm", (16,)), ("embedding", (10, 8)), ("vocab_embedding", (11, 6)),
                                       ("classifier", (8, 3)), ("lm_head", (6, 11, False))])
def test_default_init_2p5d_equals_serial(kind, args):
    run_on_ranks(check_default_init, 8, "2.5d", kind, args, 5)


@pytest.mark.parametrize("kind,args,rule", [
    ("norm", (5,), "LayerNorm2p5D needs normalized_shape divisible by q=2; got 5"),
    ("embedding", (10, 6), "Embedding2p5D needs embedding_dim divisible by q*q=4; got 6"),
    ("vocab_embedding", (10, 5), "VocabParallelEmbedding2p5D needs embedding_dim divisible by q=2; got 5"),
    ("classifier", (6, 3), "Classifier2p5D needs in_features divisible by q*q=4; got 6"),
    ("lm_head", (5, 10), "LMHead2p5D needs in_features divisible by q=2; got 5"),
    ("patch", (4, 2, 3, 6), "PatchEmbedding2p5D needs hidden_size divisible by q*q=4; got 6"),
    ("patch", (5, 2, 3, 8), "PatchEmbedding2p5D needs image_size divisible by patch_size=2; got 5"),
])
def test_divisibility_errors_2p5d(kind, args, rule):
    for m in run_on_ranks(construction_error, 8, "2.5d", kind, args, {}):
        assert m is not None and rule in m and "Choose" in m  # value, rule and fix
