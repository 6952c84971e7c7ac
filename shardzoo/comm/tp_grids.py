"""The tp grids, one row each: sub-axes, shape, legal sizes, text form and default depth.

Every tp_mode lays its tp ranks out as ``depth x side x ... x side`` (the depth axis only where
the mode has one, ``sides`` axes of equal size q), tp fastest-varying in the world and the
sub-axes slow -> fast in the order below. The mesh, the planner (enumeration, placement,
volumes) and the test meshes all read this table; a new layout starts with a row here.

======= ======== ============================ ==========================
tp_mode tp size  tp sub-axes (slow -> fast)   classic name
======= ======== ============================ ==========================
1d      p        tp                           Megatron column / row
2d      q*q      tp_row, tp_col               Optimus (SUMMA)
2.5d    d*q*q    tp_dep, tp_row, tp_col       Tesseract
3d      q*q*q    tp_x, tp_y, tp_z             3D (Bian et al.)
======= ======== ============================ ==========================
"""

from __future__ import annotations

from dataclasses import dataclass


def int_root(n: int, k: int) -> int | None:
    """The integer r with r**k == n, or None."""
    r = round(n ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c > 0 and c**k == n:
            return c
    return None


@dataclass(frozen=True)
class TpGrid:
    """One tp_mode's grid.

    Attributes:
        mode: the tp_mode ("1d", "2d", "2.5d", "3d").
        sub_axes: mesh axes of the grid, slow -> fast (the depth axis first where there is one).
        sides: how many sub-axes have the side q (tp = depth * q**sides).
        depth_axis: the axis of the depth d, or None where the mode has no depth (d = 1).
        needs: the size rule as the error states it, e.g. "tp to be a perfect square q*q".
        fix: the error's suggestion, e.g. "Use tp=4, 9, 16, ... or tp_mode='1d'".
    """

    mode: str
    sub_axes: tuple[str, ...]
    sides: int
    depth_axis: str | None
    needs: str
    fix: str

    @property
    def has_depth(self) -> bool:
        """Whether tp_depth is an argument of this mode."""
        return self.depth_axis is not None

    def size(self, side: int, depth: int = 1) -> int:
        """tp of the grid with side q = ``side`` and ``depth`` (depth * q**sides)."""
        return (depth if self.has_depth else 1) * side**self.sides

    def side(self, tp: int, depth: int = 1) -> int | None:
        """The side q of a ``tp`` grid of ``depth``, or None where there is no such grid."""
        if depth < 1 or tp < 1 or tp % depth != 0 or (depth != 1 and not self.has_depth):
            return None
        return int_root(tp // depth, self.sides)

    def check_depth(self, depth: int) -> None:
        """Raise unless ``depth`` is an argument this mode takes (any >= 1 with a depth axis, else 1)."""
        if not self.has_depth and depth != 1:
            with_depth = " or ".join(repr(g.mode) for g in TP_GRIDS.values() if g.has_depth)
            raise ValueError(f"tp_depth={depth} only applies to tp_mode={with_depth}; leave it at 1 for {self.mode!r}")

    def shape(self, tp: int, depth: int = 1) -> tuple[int, ...]:
        """Sizes of ``sub_axes`` for ``tp`` ranks at ``depth``; a ValueError naming the value, the
        rule and a fix where they make no grid."""
        self.check_depth(depth)
        q = self.side(tp, depth)
        if q is None:
            got = f"tp={tp}" + (f", tp_depth={depth}" if self.has_depth else "")
            raise ValueError(f"tp_mode={self.mode!r} needs {self.needs}; got {got}. {self.fix}")
        return ((depth,) if self.has_depth else ()) + (q,) * self.sides

    def default_depth(self, tp: int) -> int:
        """The depth to use when none is given: the smallest d with tp / d a grid of the sides
        (1 where tp is one, or where the mode has no depth)."""
        if not self.has_depth:
            return 1
        return next((d for d in range(1, tp + 1) if self.side(tp, d) is not None), 1)

    def planned_depths(self, tp: int) -> list[int]:
        """Depths of the distinct grids of ``tp`` ranks, side ascending (depth descending): a grid
        mode needs q >= 2 (q = 1 is no grid), and depth >= 2 (depth 1 is the mode without one)."""
        if self.sides == 1:
            return [1]
        depths = range(tp, 1, -1) if self.has_depth else (1,)
        return [d for d in depths if (self.side(tp, d) or 0) >= 2]

    def text(self, tp: int, depth: int = 1) -> str:
        """``"tp=8,tp_mode=2.5d,tp_depth=2"``: the ParallelMesh arguments, the depth only where the
        mode has one."""
        return f"tp={tp},tp_mode={self.mode}" + (f",tp_depth={depth}" if self.has_depth else "")


TP_GRIDS: dict[str, TpGrid] = {
    g.mode: g
    for g in (
        TpGrid("1d", ("tp",), 1, None, "tp >= 1", "Use a positive tp"),
        TpGrid("2d", ("tp_row", "tp_col"), 2, None, "tp to be a perfect square q*q",
               "Use tp=4, 9, 16, ... or tp_mode='1d'"),
        TpGrid("2.5d", ("tp_dep", "tp_row", "tp_col"), 2, "tp_dep", "tp = tp_depth*q*q",
               "For example tp=8 with tp_depth=2 (q=2), or tp=4 with tp_depth=1"),
        TpGrid("3d", ("tp_x", "tp_y", "tp_z"), 3, None, "tp to be a perfect cube q*q*q",
               "Use tp=8, 27, ... or another tp_mode"),
    )
}
TP_MODES: tuple[str, ...] = tuple(TP_GRIDS)


def tp_grid(tp_mode: str) -> TpGrid:
    """The row of ``tp_mode``; a ValueError listing the modes for any other name."""
    if tp_mode not in TP_GRIDS:
        raise ValueError(f"unknown tp_mode={tp_mode!r}; use one of {', '.join(TP_MODES)}")
    return TP_GRIDS[tp_mode]
