"""ZeRO stages 0-3 (shardzoo.data_parallel) in every tp_mode with dp=2, and with sp: three AdamW
steps of a tiny GPT-2, clipped by the global gradient norm, equal the serial model trained on
the whole batch and clipped by torch.nn.utils.clip_grad_norm_ (fp32). Weights are compared at
the fp32 tolerance (1e-5 relative, 1e-6 absolute) plus 4x the serial model's own fp32 error
against float64 (testing.assert_close_conditioned), which only matters where Adam divides a
near-zero gradient by its own size; the norms at 1e-5 relative."""

import pytest
import torch

from shardzoo.testing import assert_close, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.zero_stack import CLIP, assert_weights, trained_weights, world_of

ZEROS = (0, 1, 2, 3)
# Every stage in 1d. A stage's engine does not depend on the layout beyond its parameters and
# data group (0: DDP, 1: DDP + ZeroRedundancyOptimizer, 2 / 3: FSDP2 kept / resharded after
# forward), so each other layout runs one DDP stage and one FSDP2 stage, and together they run
# every stage: sp's data group of dp x sp, and the grid layouts' FSDP2 units on grid parameters.
STAGES = {"1d": ZEROS, "1d_sp2": (0, 3), "2d": (1, 2), "2.5d": (0, 3), "3d": (1, 2)}


@pytest.mark.parametrize("layout", list(STAGES))
def test_every_zero_stage_equals_serial(layout, zero_serial):
    results = run_on_ranks(trained_weights, world_of(layout), layout, STAGES[layout], torch.float32, CLIP)[0]
    assert sorted(results) == list(STAGES[layout])
    for zero, (weights, norms) in results.items():
        assert_weights(weights, zero_serial, f"{layout} zero={zero}")
        assert_close(torch.tensor(norms), torch.tensor(zero_serial[2]), f"{layout} zero={zero} global_grad_norm",
                     terms=TINY_MODEL_TERMS)
    assert min(zero_serial[2]) > CLIP, f"every step must clip for the test to check clipping: norms {zero_serial[2]}"
