"""ZeRO stages 0-3 (shardzoo.data_parallel) in every tp_mode with dp=2, and with sp: three AdamW
steps of a tiny GPT-2, clipped by the global gradient norm, equal the serial model trained on
the whole batch and clipped by torch.nn.utils.clip_grad_norm_ (fp32). Weights are compared at
the fp32 tolerance (1e-5 relative, 1e-6 absolute) plus 4x the serial model's own fp32 error
against float64 (testing.assert_close_conditioned), which only matters where Adam divides a
near-zero gradient by its own size; the norms at 1e-5 relative."""

import pytest
import torch

from shardzoo.testing import assert_close_conditioned, run_on_ranks
from zero_stack import CLIP, serial_clipped, trained_weights, world_of

ZEROS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def serial():
    """Serial weights and norms after the same clipped steps on the whole batch: fp32 and float64."""
    w32, norms = run_on_ranks(serial_clipped, 1, CLIP)[0]
    w64, _ = run_on_ranks(serial_clipped, 1, CLIP, torch.float64)[0]
    return w32, w64, norms


def assert_weights(got: dict, serial, what: str) -> None:
    w32, w64, _ = serial
    missing = set(w32) - set(got)
    assert not missing, f"{what}: missing {sorted(missing)}"
    for name in got.keys() & w32.keys():
        assert_close_conditioned(got[name], w32[name], w64[name], f"{what} {name}")


@pytest.mark.parametrize("layout", ["1d", "2d", "2.5d", "3d", "1d_sp2"])
def test_every_zero_stage_equals_serial(layout, serial):
    results = run_on_ranks(trained_weights, world_of(layout), layout, ZEROS, torch.float32, CLIP)[0]
    assert sorted(results) == list(ZEROS)
    for zero, (weights, norms) in results.items():
        assert_weights(weights, serial, f"{layout} zero={zero}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(serial[2]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{layout} zero={zero} global_grad_norm vs serial: {m}")
    assert min(serial[2]) > CLIP, f"every step must clip for the test to check clipping: norms {serial[2]}"
