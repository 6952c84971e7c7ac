"""The expert axes of a ParallelMesh: dp x sp split another way for expert parallelism.

The dp x sp ranks (row-major: dp slower, sp faster) are cut into groups of ``ep`` consecutive
ranks, the ep groups, each holding one copy of every MoE layer's experts split ``ep`` ways;
the ranks at the same place of each ep group form an expert data parallel group ("edp", dp*sp
/ ep ranks) holding the same experts, whose gradients are averaged there. Consecutive ranks
keep the token exchange within sp (or within neighbouring dp replicas) where ep allows.
"""

from __future__ import annotations

EXPERT_AXES = ("edp", "ep")  # in mesh order: they stand where dp and sp stand


def check_ep(ep, dp: int, sp: int) -> None:
    """Raise unless ``ep`` divides dp*sp (nothing has been built yet)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ParallelMesh(ep={ep!r}): ep, the number of ranks the experts are split over, must be a "
                         f"positive integer (1: no expert parallelism)")
    if (dp * sp) % ep != 0:
        divisors = [d for d in range(1, dp * sp + 1) if (dp * sp) % d == 0]
        raise ValueError(f"ParallelMesh(ep={ep}) with dp={dp}, sp={sp}: ep must divide dp*sp = {dp * sp} (the experts "
                         f"are split over ep of the dp x sp ranks and replicated over the rest); use ep in {divisors}, "
                         f"or change dp / sp")


class ExpertAxes:
    """Sizes, coordinates, ranks and (made on first use) groups of the "ep" and "edp" axes of
    ``mesh``, a ParallelMesh whose dp, sp, pp and tp axes exist already."""

    def __init__(self, mesh, ep: int):
        self.mesh = mesh
        dp, sp = mesh._sizes["dp"], mesh._sizes["sp"]
        self.sizes = {"edp": dp * sp // ep, "ep": ep}
        flat = mesh._coord["dp"] * sp + mesh._coord["sp"]  # this rank's index in dp x sp
        self.coord = {"edp": flat // ep, "ep": flat % ep}
        self._device_mesh = None

    def _order(self) -> tuple[str, ...]:
        return EXPERT_AXES + ("pp",) + self.mesh.tp_sub_axes

    def ranks(self, axes: tuple[str, ...]) -> list[int]:
        """Global ranks of this rank's group over ``axes`` (expert axes with pp / tp ones), in
        group-rank order (row-major over edp, ep, pp, tp)."""
        world = self.mesh.device_mesh.mesh  # [dp, pp, sp, *tp]
        order = self._order()
        grid = world.transpose(1, 2).reshape((self.sizes["edp"], self.sizes["ep"]) + tuple(world.shape[1:2]) +
                                             tuple(world.shape[3:]))
        coord = {**self.coord, **self.mesh._coord}
        index = tuple(slice(None) if a in axes else coord[a] for a in order)
        return [int(r) for r in grid[index].flatten().tolist()]

    def device_mesh(self):
        """The DeviceMesh [edp, ep] of this rank's dp x sp group (collective on first use)."""
        if self._device_mesh is None:
            override = self.mesh._override
            kwargs = {"backend_override": {"edp": override, "ep": override}} if override else {}
            flat = self.mesh.sub_mesh("dp", "sp")
            self._device_mesh = flat._unflatten(0, (self.sizes["edp"], self.sizes["ep"]), EXPERT_AXES, **kwargs)
        return self._device_mesh

    def sub_mesh(self, axes: tuple[str, ...]):
        """The 1-D DeviceMesh of one expert axis."""
        if len(axes) != 1:
            raise ValueError(f"mesh axes {axes}: the groups of the expert axes are made one at a time; ask for "
                             f"group('ep') or group('edp')")
        return self.device_mesh()[axes[0]]

    def meshes(self) -> list:
        return [] if self._device_mesh is None else [self._device_mesh]

    def groups(self) -> list:
        if self._device_mesh is None:
            return []
        return [self._device_mesh.get_group(a) for a in EXPERT_AXES]

    def forget(self) -> None:
        self._device_mesh = None
