"""One persistent WorkerPool per world size for a whole test run (or any long session).

``run_on_ranks(fn, world_size, *args)`` sends ``fn`` to the cached pool for that world size,
spawning it on first use and replacing it when a failure or timeout closed it, so a
hypothesis example on 8 ranks costs a round trip of a few milliseconds.
"""

from __future__ import annotations

import atexit
import gc
from typing import Any, Callable

from shardzoo.comm.workers import WorkerPool

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
    return get_pool(world_size).run(fn, *args, timeout=timeout)


def close_pools() -> None:
    """Shut every cached pool down (also done at interpreter exit)."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()


atexit.register(close_pools)


_meshes: dict[tuple, object] = {}
MESH_CACHE_SIZE = 2  # meshes kept per worker process; older ones are closed


def cached_mesh(**layout):
    """A ``ParallelMesh(**layout)`` built once per worker process and reused by later tests,
    so property tests do not create new process groups for every example. The least recently
    used meshes beyond ``MESH_CACHE_SIZE`` are closed: idle gloo groups cost CPU time (each has
    a polling network thread), and a test session builds hundreds of groups otherwise. Every
    rank of a pool runs the same tests, so the ranks create and close groups in the same order."""
    from shardzoo.comm.mesh import ParallelMesh

    key = tuple(sorted(layout.items()))
    mesh = _meshes.pop(key, None)
    if mesh is None:
        mesh = ParallelMesh(**layout)
    _meshes[key] = mesh  # most recently used last
    if len(_meshes) > MESH_CACHE_SIZE:
        while len(_meshes) > MESH_CACHE_SIZE:
            _meshes.pop(next(iter(_meshes))).close()
        gc.collect()  # a destroyed group's thread ends with the group's last (often cyclic) reference
    return mesh
