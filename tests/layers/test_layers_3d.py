"""3D (Bian et al.) layers against their serial twins at tp=8 (q=2), including chained layers
whose input / output cube axes alternate. Harness: test_layouts.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.testing import run_on_ranks
from grid_chaining import check_layout_guard, check_mlp_training
from test_layouts import (check_default_init, check_linear, check_lm, check_module, check_patch, construction_error,
                          linear_case, lm_case, mlp_case, module_case, patch_case, world_of)


@given(data=st.data())
@settings(max_examples=12)
def test_linear_3d_matches_serial(data):
    case = linear_case(data.draw, "3d")
    shapes = run_on_ranks(check_linear, 8, case)
    assert shapes[0] == (case["batch"], case["seq"], case["out"])


def test_linear_3d_fixed_largest():
    case = dict(name="3d", **{"in": 64}, out=96, batch=8, seq=16, bias=True, dtype="fp32", seed=5, from_serial=False)
    run_on_ranks(check_linear, 8, case)


@pytest.mark.parametrize("args,rule", [((7, 4), "in_features divisible by q=2; got 7"),
                                       ((4, 6), "out_features divisible by q*q=4; got 6")])
def test_linear_3d_divisibility_error(args, rule):
    for m in run_on_ranks(construction_error, 8, "3d", "linear", args, {}):
        assert m is not None and f"ParallelLinear3D needs {rule}" in m


KINDS = ["norm", "embedding", "vocab_embedding", "classifier"]


@pytest.mark.parametrize("name", ["3d"])
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
@settings(max_examples=5)
def test_module_3d_matches_serial(name, kind, data):
    run_on_ranks(check_module, world_of(name), module_case(data.draw, name, kind))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@given(data=st.data())
@settings(max_examples=2)
def test_lm_head_3d_with_cross_entropy(reduction, data):
    run_on_ranks(check_lm, 8, lm_case(data.draw, "3d", reduction))


@given(data=st.data())
@settings(max_examples=5)
def test_patch_embedding_3d_matches_vit(data):
    run_on_ranks(check_patch, 8, patch_case(data.draw, "3d"))


@pytest.mark.parametrize("name", ["3d"])
@given(data=st.data())
@settings(max_examples=4)
def test_mlp_block_3d_three_adamw_steps(name, data):
    run_on_ranks(check_mlp_training, world_of(name), mlp_case(data.draw, name))


def test_mlp_block_3d_fixed_largest():
    run_on_ranks(check_mlp_training, 8, dict(name="3d", hidden=32, ffn=128, batch=8, seq=8, dtype="fp32", seed=3))


@pytest.mark.parametrize("kind,args", [("norm", (16,)), ("embedding", (10, 8)), ("vocab_embedding", (11, 6)),
                                       ("classifier", (8, 3)), ("lm_head", (6, 11, False))])
def test_default_init_3d_equals_serial(kind, args):
    run_on_ranks(check_default_init, 8, "3d", kind, args, 5)


@pytest.mark.parametrize("kind,args,rule", [
    ("norm", (5,), "LayerNorm3D needs normalized_shape divisible by q=2; got 5"),
    ("embedding", (10, 12), "Embedding3D needs embedding_dim divisible by q*q*q=8; got 12"),
    ("vocab_embedding", (10, 5), "VocabParallelEmbedding3D needs embedding_dim divisible by q=2; got 5"),
    ("classifier", (12, 3), "Classifier3D needs in_features divisible by q*q*q=8; got 12"),
    ("lm_head", (5, 10), "LMHead3D needs in_features divisible by q=2; got 5"),
    ("patch", (4, 2, 3, 12), "PatchEmbedding3D needs hidden_size divisible by q*q*q=8; got 12"),
    ("patch", (5, 2, 3, 8), "PatchEmbedding3D needs image_size divisible by patch_size=2; got 5"),
])
def test_divisibility_errors_3d(kind, args, rule):
    for m in run_on_ranks(construction_error, 8, "3d", kind, args, {}):
        assert m is not None and rule in m and "Choose" in m  # value, rule and fix


def test_layout_guard_3d():
    """fc2 built for the canonical layout, fed fc1's swapped output, raises; input_layout fixes it."""
    assert all(run_on_ranks(check_layout_guard, 8, "3d", 1))
