"""The demo's comparison itself: every layout it shows equals the serial block."""

import pytest

from shardzoo.demo import LAYOUTS_BY_WORLD, _demo_on_ranks
from shardzoo.testing import run_on_ranks


@pytest.mark.parametrize("world", [2, 4, 8])
def test_demo_layouts_match_serial(world):
    per_rank = run_on_ranks(_demo_on_ranks, world, LAYOUTS_BY_WORLD[world], 32, 8, 4, 3)
    for rows in per_rank:
        assert len(rows) == len(LAYOUTS_BY_WORLD[world])
        for row in rows:
            assert row["out_diff"] < 1e-5 and row["input_grad_diff"] < 1e-5 and row["param_grad_diff"] < 1e-5, row
            # Each layout keeps about 1/tp of the parameters (biases may be replicated).
            assert row["param_bytes"] < row["serial_param_bytes"] * 0.6
