"""A model of one's own, with its plan, split by ``shardzoo.parallelize`` in every layout: loss,
logits and every parameter after one optimizer step equal the serial model."""

import pytest

from shardzoo.testing import run_on_ranks
from shardzoo.testing.user_model import check_user_model

LAYOUTS = {
    "1d-tp4": (dict(tp=4), 4),
    "2d": (dict(tp=4, tp_mode="2d"), 4),
    "2.5d-depth2": (dict(tp=8, tp_mode="2.5d", tp_depth=2), 8),
    "3d": (dict(tp=8, tp_mode="3d"), 8),
    "1d-tp2-dp2": (dict(tp=2, dp=2), 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_user_model_equals_serial(layout):
    mesh_kwargs, world = LAYOUTS[layout]
    run_on_ranks(check_user_model, world, mesh_kwargs)
