"""Shared test settings: one hypothesis profile for every test, pools closed at the end."""

import os

import pytest
from hypothesis import HealthCheck, settings

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
