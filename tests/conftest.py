"""Shared test settings: one hypothesis profile for every test, pools closed at the end."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton decides at kernel-wrapping time whether to interpret; any test may be the first to
# import shardzoo.kernels, so without a GPU the interpreter is switched on before all of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "default",
    deadline=None,  # multi-rank examples include inter-process round trips
    max_examples=int(os.environ.get("SHARDZOO_MAX_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("default")


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    from shardzoo.testing import close_pools

    close_pools()
