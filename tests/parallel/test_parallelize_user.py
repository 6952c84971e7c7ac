"""A model of one's own, with its plan, split by ``shardzoo.parallelize`` in every layout: loss,
logits and every parameter after one optimizer step equal the serial model; under sp its
``F.scaled_dot_product_attention`` calls run over the sequence (parallel/sdpa_mode.py)."""

import pytest

from shardzoo.testing import run_on_ranks
from shardzoo.testing.meshes import with_world
from support.user_model import check_user_model

LAYOUTS = {
    "1d-tp4": with_world(tp=4),
    "2d": with_world(tp=4, tp_mode="2d"),
    "2.5d-depth2": with_world(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d": with_world(tp=8, tp_mode="3d"),
    "1d-tp2-dp2": with_world(tp=2, dp=2),
}

# (mesh, sp_mode, padded)
SEQUENCE_PARALLEL = {
    "1d-tp2-sp2-ring": (with_world(tp=2, sp=2), "ring", False),
    "1d-tp2-sp2-ulysses": (with_world(tp=2, sp=2), "ulysses", False),
    "1d-tp2-sp2-ring-padded": (with_world(tp=2, sp=2), "ring", True),
    "1d-tp2-sp2-ulysses-padded": (with_world(tp=2, sp=2), "ulysses", True),
    "2d-tp4-sp2-ring": (with_world(tp=4, tp_mode="2d", sp=2), "ring", False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_user_model_equals_serial(layout):
    mesh_kwargs, world = LAYOUTS[layout]
    run_on_ranks(check_user_model, world, mesh_kwargs)


@pytest.mark.parametrize("case", list(SEQUENCE_PARALLEL))
def test_user_model_with_sequence_parallel_sdpa_equals_serial(case):
    (mesh_kwargs, world), sp_mode, padded = SEQUENCE_PARALLEL[case]
    run_on_ranks(check_user_model, world, mesh_kwargs, sp_mode, padded)


@pytest.mark.parametrize("layout", ["1d-tp4", "2d", "3d"])
def test_user_model_with_a_dense_projection_equals_serial(layout):
    """'dense': the projection's output stays in the activation layout (3d moves it back)."""
    mesh_kwargs, world = LAYOUTS[layout]
    run_on_ranks(check_user_model, world, mesh_kwargs, "ring", False, True)
