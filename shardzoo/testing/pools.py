"""One persistent WorkerPool per world size for a whole test run (or any long session).

``run_on_ranks(fn, world_size, *args)`` sends ``fn`` to the cached pool for that world size,
spawning it on first use and replacing it when a failure or timeout closed it, so a
hypothesis example on 8 ranks costs a round trip of a few milliseconds.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable

from shardzoo.comm.mesh_cache import MESH_CACHE_SIZE, cached_mesh  # noqa: F401  (part of shardzoo.testing)
from shardzoo.comm.workers import WorkerPool
from shardzoo.testing import margins

DEFAULT_TIMEOUT_S = 120.0
_pools: dict[int, WorkerPool] = {}


def get_pool(world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> WorkerPool:
    """The live pool of ``world_size`` ranks, creating (or replacing a closed) one."""
    pool = _pools.get(world_size)
    if pool is None or not pool.healthy:
        pool = WorkerPool(world_size, timeout=timeout)
        _pools[world_size] = pool
    return pool


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on every rank of the cached ``world_size`` pool; per-rank results.

    ``fn`` must be a module-level function; inside it torch.distributed is initialised with
    ``world_size`` ranks, so it can build a ``ParallelMesh``. Failures re-raise here with the
    failing rank and its remote traceback."""
    if os.environ.get(margins.ENV):  # label the workers' margin records with the running test
        return get_pool(world_size).run(margins.labelled, margins.test_id(), fn, *args, timeout=timeout)
    return get_pool(world_size).run(fn, *args, timeout=timeout)


def close_pools() -> None:
    """Shut every cached pool down (also done at interpreter exit)."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()


atexit.register(close_pools)
