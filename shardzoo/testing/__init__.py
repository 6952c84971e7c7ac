"""Helpers to test parallel code against its serial twin: worker pools and asserts.

What a user needs to test their own code: the pools (pools.py), the asserts and the tolerance
rule (asserts.py, dtypes.py, margins.py), test meshes (meshes.py), a layer's serial-twin check
(serial_twin.py), the grid MLP (grid.py), kernel helpers (kernels.py) and packed-document lengths
(packed_attention.py). The suite's own scenarios live in tests/support/ (docs/design.md).

    from shardzoo.testing import run_on_ranks

    def check(seed):            # module-level, runs on every rank
        mesh = shardzoo.ParallelMesh(tp=4)
        ...
        return max_error

    errors = run_on_ranks(check, 4, 0)
"""

from shardzoo.testing.asserts import TOLERANCES, assert_close, assert_close_conditioned, error_messages, tolerance
from shardzoo.testing.dtypes import DTYPES, dtypes, model_terms, reorder_bound, rms_of
from shardzoo.testing.pools import cached_mesh, close_pools, get_pool, run_on_ranks

__all__ = ["DTYPES", "dtypes", "TOLERANCES", "assert_close", "assert_close_conditioned", "tolerance", "reorder_bound",
           "model_terms", "rms_of", "cached_mesh",
           "close_pools", "get_pool", "run_on_ranks"]
