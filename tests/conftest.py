"""Shared test settings: one hypothesis profile for every test, pools closed at the end, and the
margin report (``pytest --margins``, or SHARDZOO_MARGINS=DIR)."""

import os
import tempfile

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


def pytest_addoption(parser):
    parser.addoption("--margins", action="store_true",
                     help="print the 20 parallel-vs-serial comparisons that used the most of their bound, and fail "
                          "if any used more than half of it (also on with SHARDZOO_MARGINS=DIR)")


def pytest_configure(config):
    # Before any worker pool spawns: the workers inherit the variable and write their records too.
    # (shardzoo is imported in the hooks, after TRITON_INTERPRET is set above.)
    from shardzoo.testing import margins

    if config.getoption("--margins") and not os.environ.get(margins.ENV):
        os.environ[margins.ENV] = tempfile.mkdtemp(prefix="shardzoo-margins-")
    elif os.environ.get(margins.ENV):  # SHARDZOO_MARGINS=DIR names a folder that may not exist yet
        os.makedirs(os.environ[margins.ENV], exist_ok=True)


def pytest_sessionfinish(session, exitstatus):
    from shardzoo.testing import margins

    folder = os.environ.get(margins.ENV)
    if not folder:
        return
    from shardzoo.testing import close_pools

    close_pools()  # the workers' records are complete once they have exited
    rows, count = margins.tightest(folder)
    over = [r for r in rows if r["used"] > margins.LIMIT]
    lines = [f"margin report: {count} comparisons recorded in {folder}; the 20 tightest (fraction of the bound used):",
             *margins.format_rows(rows)]
    if over:
        lines.append(f"FAILED: {len(over)} of these used more than {margins.LIMIT} of their bound")
        session.exitstatus = 1
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        reporter.write_line(line) if reporter else print(line)
