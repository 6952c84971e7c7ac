"""Test meshes as ``(ParallelMesh kwargs, world size)``, the world and the tp grid's sizes read
off comm's grid table (``shardzoo.comm.tp_grids``) instead of written out per test:

    LAYOUTS = {"2.5d": with_world(tp=8, tp_mode="2.5d", tp_depth=2)}   # ({...}, 8)
"""

from __future__ import annotations

import math

from shardzoo.comm.tp_grids import tp_grid
from shardzoo.layers.placements import canonical_for

_SIZE_KEYS = ("dp", "pp", "sp", "tp")


def tp_shape(kwargs: dict) -> dict[str, int]:
    """Sizes of the tp sub-axes of a mesh's kwargs, by axis name; a ValueError for a tp the mode
    has no grid for, so a test table cannot name one."""
    grid = tp_grid(kwargs.get("tp_mode", "1d"))
    return dict(zip(grid.sub_axes, grid.shape(kwargs.get("tp", 1), kwargs.get("tp_depth", 1))))


def world_of_kwargs(kwargs: dict) -> int:
    """Processes the mesh of ``kwargs`` needs: dp * pp * sp * tp (a missing size is 1)."""
    tp_shape(kwargs)
    return math.prod(kwargs.get(k, 1) for k in _SIZE_KEYS)


def with_world(**kwargs) -> tuple[dict, int]:
    """``(kwargs, world)`` of a test mesh, its tp grid checked."""
    return kwargs, world_of_kwargs(kwargs)


def batch_parts(kwargs: dict) -> int:
    """Parts the mode's canonical activation cuts the batch (dim 0) into on this mesh: the
    product of its batch axes (layers/placements.py); a batch must be a multiple of it."""
    sizes = tp_shape(kwargs)
    return math.prod(sizes[a] for a in canonical_for(kwargs.get("tp_mode", "1d")).batch_axes)


def hidden_parts(tp_mode: str, q: int) -> int:
    """Pieces an H-indexed table is cut into on a grid of side ``q``: q per side of the grid
    (q*q in 2D / 2.5D, whose depth holds replicas; q^3 in 3D)."""
    return q ** tp_grid(tp_mode).sides
