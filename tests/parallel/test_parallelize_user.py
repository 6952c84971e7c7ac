"""A model of one's own, with its plan, split by ``shardzoo.parallelize`` in every layout: loss,
logits and every parameter after one optimizer step equal the serial model."""

import pytest

from shardzoo.testing import run_on_ranks
from shardzoo.testing.meshes import with_world
from shardzoo.testing.user_model import check_user_model

LAYOUTS = {
    "1d-tp4": with_world(tp=4),
    "2d": with_world(tp=4, tp_mode="2d"),
    "2.5d-depth2": with_world(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d": with_world(tp=8, tp_mode="3d"),
    "1d-tp2-dp2": with_world(tp=2, dp=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_user_model_equals_serial(layout):
    mesh_kwargs, world = LAYOUTS[layout]
    run_on_ranks(check_user_model, world, mesh_kwargs)
