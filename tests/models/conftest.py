"""Fixtures shared by the model tests."""

import pytest
import torch

from shardzoo.testing import run_on_ranks
from support.zero_stack import CLIP, serial_clipped


@pytest.fixture(scope="session")
def zero_serial():
    """For the ZeRO tests: serial weights and norms after the clipped steps on the whole batch
    (tests/support/zero_stack.py), in fp32 and float64."""
    w32, norms = run_on_ranks(serial_clipped, 1, CLIP)[0]
    w64, _ = run_on_ranks(serial_clipped, 1, CLIP, torch.float64)[0]
    return w32, w64, norms
