"""ZeRO stages 0-3 (shardzoo.data_parallel) in every tp_mode with dp=2, and with sp: three AdamW
steps of a tiny GPT-2 equal the serial model trained on the whole batch (fp32). Weights are
compared at the fp32 tolerance (1e-5 relative, 1e-6 absolute) plus 4x the serial model's own
fp32 error against float64 (testing.assert_close_conditioned), which only matters where Adam
divides a near-zero gradient by its own size."""

import pytest
import torch

from shardzoo.testing import assert_close_conditioned, run_on_ranks
from zero_stack import trained_weights, world_of

ZEROS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def serial():
    """Serial weights after the same steps on the whole batch: fp32 and float64."""
    w32 = run_on_ranks(trained_weights, 1, "serial", (0,))[0][0][0]
    w64 = run_on_ranks(trained_weights, 1, "serial", (0,), torch.float64)[0][0][0]
    return w32, w64


def assert_weights(got: dict, serial, what: str) -> None:
    w32, w64 = serial
    assert set(got) == set(w32), what
    for name, ref in w32.items():
        assert_close_conditioned(got[name], ref, w64[name], f"{what} {name}")


@pytest.mark.parametrize("layout", ["1d", "2d", "2.5d", "3d", "1d_sp2"])
def test_every_zero_stage_equals_serial(layout, serial):
    results = run_on_ranks(trained_weights, world_of(layout), layout, ZEROS)[0]
    assert sorted(results) == list(ZEROS)
    for zero, (weights, _) in results.items():
        assert_weights(weights, serial, f"{layout} zero={zero}")
