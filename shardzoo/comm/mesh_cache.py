"""``cached_mesh``: one ``ParallelMesh`` per layout per worker process, reused across calls.

In ``comm`` (not ``testing``) because the planner's measurement runs use it as well as the
tests, and the planner sits below ``testing`` (docs/design.md, "Package layering").
"""

from __future__ import annotations

import gc

from shardzoo.comm.mesh import ParallelMesh

_meshes: dict[tuple, object] = {}
MESH_CACHE_SIZE = 2  # meshes kept per worker process; older ones are closed


def cached_mesh(**layout):
    """A ``ParallelMesh(**layout)`` built once per worker process and reused by later tests,
    so property tests do not create new process groups for every example. The least recently
    used meshes beyond ``MESH_CACHE_SIZE`` are closed: idle gloo groups cost CPU time (each has
    a polling network thread), and a test session builds hundreds of groups otherwise. Every
    rank of a pool runs the same tests, so the ranks create and close groups in the same order."""
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
