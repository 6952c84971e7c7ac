"""ParallelMesh: one explicit object holding every process group a layer needs.

The world is a grid ``dp x pp x sp x tp`` (tp fastest-varying), and the tp axis is itself a
sub-grid that depends on ``tp_mode``: its sub-axes, sizes and legal tp are the rows of
:data:`shardzoo.comm.tp_grids.TP_GRIDS` (1d: tp; 2d: tp_row x tp_col; 2.5d: tp_dep x tp_row x
tp_col; 3d: tp_x x tp_y x tp_z).

Groups come from torch's DeviceMesh (``mesh.device_mesh``), so they are ordinary process groups
usable with DDP, FSDP2 and DTensor. Two meshes can live in one process; nothing is global.
"""

from __future__ import annotations

import datetime
import math
import os
from functools import reduce as _reduce

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardzoo.comm.expert_mesh import EXPERT_AXES, ExpertAxes, check_ep
from shardzoo.comm.tp_grids import TP_MODES, tp_grid  # noqa: F401  (TP_MODES: the public name stays here too)


def default_tp_depth(tp: int, tp_mode: str) -> int:
    """The tp_depth to use when none is given: 1, except 2.5d where it is the smallest d with
    tp / d a perfect square (1 when tp is a square)."""
    return tp_grid(tp_mode).default_depth(tp)


def tp_grid_text(tp: int, tp_mode: str, tp_depth: int = 1) -> str:
    """``"tp=8,tp_mode=2.5d,tp_depth=2"``: the ParallelMesh arguments of a tp grid, the depth
    only where the mode has one."""
    return tp_grid(tp_mode).text(tp, tp_depth)


def tp_sub_shape(tp: int, tp_mode: str, tp_depth: int = 1) -> tuple[int, ...]:
    """Sizes of the tp sub-axes for ``tp_mode`` (comm/tp_grids.py), with clear errors."""
    return tp_grid(tp_mode).shape(tp, tp_depth)


def _check_size_values(sizes: dict[str, int | None]) -> None:
    for k, v in sizes.items():
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{k}={v!r} must be a positive integer (or None to infer it)")


def _infer_sizes(sizes: dict[str, int | None], world: int) -> dict[str, int]:
    missing = [k for k, v in sizes.items() if v is None]
    if len(missing) > 1:
        raise ValueError(f"only one of dp, pp, sp, tp may be None (inferred); got None for {', '.join(missing)}")
    _check_size_values(sizes)
    known = _reduce(lambda a, b: a * b, [v for v in sizes.values() if v is not None], 1)
    if missing:
        if world % known != 0:
            raise ValueError(
                f"cannot infer {missing[0]}: world size {world} is not divisible by the product "
                f"of the other axes ({known}); change the other sizes or the number of processes"
            )
        sizes = {**sizes, missing[0]: world // known}
    product = math.prod(sizes.values())
    if product != world:
        layout = " * ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(
            f"world size {world} != {layout} = {product}; launch {product} processes or change the "
            f"axis sizes so their product is {world} (one of them may be None to infer it)"
        )
    return sizes  # type: ignore[return-value]


def _start_serial_group(sizes: dict[str, int | None], timeout: float | None) -> None:
    """With no process group: under torchrun's environment, the default group of the world
    torchrun started (launch.init_from_env); else a mesh of one rank (every size 1 or None)
    starts a one-process group itself (launch.init_single_process), so the serial twin runs in
    a notebook or a plain script; anything larger needs the processes a launcher starts."""
    _check_size_values(sizes)
    from shardzoo.comm.launch import init_from_env, under_torchrun

    if dist.is_available() and under_torchrun():  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        init_from_env(timeout=600.0 if timeout is None else timeout)  # gloo on CPU, NCCL on CUDA, as launch does
        return
    larger = {k: v for k, v in sizes.items() if v not in (1, None)}
    launched = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if dist.is_available() and not larger and launched == 1:
        from shardzoo.comm.launch import init_single_process

        init_single_process(timeout)
        return
    if not dist.is_available():
        why = "this torch build has no torch.distributed"
    elif larger:
        layout = ", ".join(f"{k}={v}" for k, v in larger.items())
        why = f"ParallelMesh({layout}) needs {math.prod(larger.values())} processes and none were started"
    else:
        why = f"WORLD_SIZE={launched} says this is one of {launched} processes, but none initialised the group"
    raise RuntimeError(
        f"ParallelMesh needs an initialised torch.distributed default process group ({why}); run "
        f"your script with `torchrun --nproc-per-node N script.py` or call it through "
        f"shardzoo.launch(fn, nprocs=N), which both initialise it. Without a launcher only the serial mesh "
        f"(every size 1) starts its own one-process group"
    )


def _backend_override(timeout: datetime.timedelta | None):
    """Per-group options carrying the collective timeout, so a dead rank raises instead of
    hanging forever."""
    if timeout is None:
        return None
    backend = dist.get_backend()
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return None
    opts._timeout = timeout
    return backend, opts


class ParallelMesh:
    """Process groups for data, pipeline, sequence and tensor parallelism.

    Args:
        dp, pp, sp, tp: axis sizes; their product must equal the world size. One may be None
            and is inferred.
        ep: expert parallelism: the experts of a MoE layer are split over groups of ``ep``
            ranks of the dp x sp group (``group("ep")``, consecutive in dp x sp order, so an ep
            equal to sp splits them over the sp ranks) and replicated over the rest of it, the
            expert data parallel group (``group("edp")``, dp*sp/ep ranks), where their
            gradients are averaged. ep divides dp*sp and adds no ranks; 1 (default): no split.
        tp_mode: "1d", "2d", "2.5d" or "3d" (the sub-grid of the tp axis).
        tp_depth: depth d of the 2.5d grid (tp = d*q*q).
        timeout: collective timeout of the groups (default: 10 minutes), so a dead rank makes
            the others raise instead of waiting forever.
        sync_rng: give every rank of each tp x sp group the default RNG state (CPU, and the
            current CUDA device under NCCL) of that group's first rank, so that dropout on
            activations replicated over tp, and any other draw outside the tp region, is the
            same on all of them (one ~5 KB broadcast per sp / tp axis of size > 1, now). Ranks
            already alike are left exactly as they were. The per-rank tp stream
            (layers/rng_streams.py) still differs per tp rank. False leaves every generator alone.

    Axis names: "dp", "pp", "sp", "tp" and the tp sub-axes of the mode (module docstring).
    ``mesh.group("tp_row", "tp_col")`` returns the group spanning several axes. The expert axes
    "ep" and "edp" (:data:`EXPERT_AXES`) split dp x sp another way: ``size``, ``rank`` and
    ``ranks`` take them in place of dp and sp (with the tp axes), ``group`` and ``sub_mesh``
    one at a time; their groups are made on first use (expert_mesh.py).
    """

    def __init__(
        self,
        dp: int | None = 1,
        pp: int | None = 1,
        sp: int | None = 1,
        tp: int | None = 1,
        tp_mode: str = "1d",
        tp_depth: int = 1,
        *,
        timeout: datetime.timedelta | float | None = 600.0,
        sync_rng: bool = True,
        ep: int = 1,
    ):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if timeout is not None and not seconds > 0:  # checked before any group exists
            raise ValueError(f"ParallelMesh(timeout={timeout!r}): the collective timeout must be positive (seconds or a "
                             f"timedelta), or None for torch's default")
        if not dist.is_available() or not dist.is_initialized():
            _start_serial_group({"dp": dp, "pp": pp, "sp": sp, "tp": tp}, seconds)
        self.tp_grid = tp_grid(tp_mode)
        world = dist.get_world_size()
        sizes = _infer_sizes({"dp": dp, "pp": pp, "sp": sp, "tp": tp}, world)
        check_ep(ep, sizes["dp"], sizes["sp"])  # before any group is made
        self.tp_mode = tp_mode
        self.tp_sub_axes = self.tp_grid.sub_axes
        tp_shape = self.tp_grid.shape(sizes["tp"], tp_depth)
        self.axis_names: tuple[str, ...] = ("dp", "pp", "sp") + self.tp_sub_axes
        self._sizes = {**sizes, **dict(zip(self.tp_sub_axes, tp_shape))}
        shape = tuple(self._sizes[a] for a in self.axis_names)
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        override = _backend_override(timeout)
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        kwargs = {"backend_override": {n: override for n in self.axis_names}} if override else {}
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=self.axis_names, **kwargs)
        self._override = override
        self._combined: dict[tuple[str, ...], DeviceMesh] = {}
        self._adopted: list = []  # groups others made for this mesh, closed with it
        coord = self.device_mesh.get_coordinate()
        self._coord = dict(zip(self.axis_names, coord))
        self.expert = ExpertAxes(self, ep)
        if sync_rng:
            self._sync_default_rng()

    def _sync_default_rng(self) -> None:
        """Broadcast the default generators' state from the first rank of each tp x sp group:
        along each sp / tp axis in turn from coordinate 0, which ends with the state of the
        rank at coordinate 0 on all of them (each axis's own group: no group is created)."""
        cuda = dist.get_backend() == "nccl"
        for axis in ("sp",) + self.tp_sub_axes:
            if self._sizes[axis] == 1:
                continue
            group = self.device_mesh.get_group(axis)
            src = dist.get_global_rank(group, 0)
            state = torch.get_rng_state()
            if cuda:  # NCCL moves CUDA tensors only
                state, device_state = state.cuda(), torch.cuda.get_rng_state().cuda()
                dist.broadcast(device_state, src=src, group=group)
                torch.cuda.set_rng_state(device_state.cpu())
            dist.broadcast(state, src=src, group=group)
            torch.set_rng_state(state.cpu())

    # -- sizes and coordinates ------------------------------------------------------------
    def expand_axes(self, *axes: str) -> tuple[str, ...]:
        """Mesh axes named by ``axes`` with "tp" expanded into the mode's sub-axes, checked and
        in mesh order: ``expand_axes("tp", "dp")`` on a 2d mesh is ("dp", "tp_row", "tp_col")."""
        expanded: list[str] = []
        tp_is_split = "tp" not in self.tp_sub_axes  # the grid modes: "tp" names all their sub-axes
        for a in axes:
            if a == "tp" and tp_is_split:
                expanded.extend(self.tp_sub_axes)
            elif a in self.axis_names or a in EXPERT_AXES:
                expanded.append(a)
            else:
                names = ", ".join(("tp",) + self.axis_names if tp_is_split else self.axis_names)
                raise ValueError(f"unknown mesh axis {a!r} for tp_mode={self.tp_mode!r}; axes are {names}")
        if len(set(expanded)) != len(expanded):
            raise ValueError(f"mesh axes {axes} name an axis twice")
        if set(expanded) & set(EXPERT_AXES) and set(expanded) & {"dp", "sp"}:
            raise ValueError(f"mesh axes {axes}: the expert axes ep / edp split dp x sp another way and do not combine "
                             f"with dp or sp; ask for them with the other axes (pp, tp) only")
        order = EXPERT_AXES + self.axis_names  # ep / edp stand where dp and sp do
        return tuple(sorted(expanded, key=order.index))

    def size(self, *axes: str) -> int:
        """Number of ranks spanned by ``axes`` (all axes: the world size)."""
        axes = self.expand_axes(*axes) if axes else self.axis_names
        return math.prod(self.expert.sizes[a] if a in EXPERT_AXES else self._sizes[a] for a in axes)

    def rank(self, *axes: str) -> int:
        """This rank's index in the group spanned by ``axes`` (row-major over mesh order)."""
        axes = self.expand_axes(*axes) if axes else self.axis_names
        idx = 0
        for a in axes:
            if a in EXPERT_AXES:
                idx = idx * self.expert.sizes[a] + self.expert.coord[a]
            else:
                idx = idx * self._sizes[a] + self._coord[a]
        return idx

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate on every axis, e.g. {"dp": 0, "pp": 0, "sp": 1, "tp": 0}."""
        return dict(self._coord)

    def group(self, *axes: str):
        """The process group spanning ``axes`` (e.g. ``group("tp")``, ``group("dp", "sp")``).

        Multi-axis groups are created on first use; every rank must ask for them in the same
        order, as for any torch.distributed group creation."""
        axes = self.expand_axes(*axes)
        if len(axes) == 1 and axes[0] not in EXPERT_AXES:
            return self.device_mesh.get_group(axes[0])
        return self.sub_mesh(*axes).get_group()

    def sub_mesh(self, *axes: str) -> DeviceMesh:
        """A 1-D DeviceMesh over ``axes`` (flattened when several), for DTensor / FSDP2 interop."""
        axes = self.expand_axes(*axes)
        if set(axes) & set(EXPERT_AXES):
            return self.expert.sub_mesh(axes)
        if len(axes) == 1:
            return self.device_mesh[axes[0]]
        if axes not in self._combined:
            name = "_".join(axes)
            self._combined[axes] = self.device_mesh[axes]._flatten(name, backend_override=self._override)
        return self._combined[axes]

    def close(self) -> None:
        """Destroy this mesh's process groups (all its axes and combined groups; never the
        default group). Every gloo group keeps a network thread that wakes up every few
        milliseconds, so a process that builds many meshes should close those it no longer
        uses. Local to this rank; the mesh and modules built on it must not be used afterwards."""
        default = dist.distributed_c10d._get_default_group()
        groups = [self.device_mesh.get_group(a) for a in self.axis_names]
        groups += [m.get_group() for m in self._combined.values()] + self._adopted + self.expert.groups()
        seen: set[int] = set()
        for g in groups:
            if g is None or g is default or id(g) in seen:
                continue
            seen.add(id(g))
            dist.destroy_process_group(g)
        # A DeviceMesh keeps its groups in a registry its slices share, and caches in torch
        # (DTensor's, FSDP2's) may keep the meshes alive: drop the groups from it, or each one's
        # thread outlives the close.
        for m in [self.device_mesh, *self._combined.values(), *self.expert.meshes()]:
            registry = getattr(m._get_root_mesh() if hasattr(m, "_get_root_mesh") else m, "_pg_registry", None)
            if isinstance(registry, dict):
                for name in [n for n, g in registry.items() if g is not default]:
                    del registry[name]
        self._combined.clear()
        self._adopted.clear()
        self.expert.forget()
        _forget_dtensor_specs()

    def adopt_group(self, group) -> None:
        """Destroy ``group`` (made for this mesh's work, e.g. a pipeline's tied-embedding
        group) when the mesh is closed."""
        if group is not None:
            self._adopted.append(group)

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group over ``axes``, in group-rank order."""
        axes = self.expand_axes(*axes)
        if set(axes) & set(EXPERT_AXES):
            return self.expert.ranks(axes)
        mesh = self.device_mesh.mesh
        index = tuple(slice(None) if a in axes else self._coord[a] for a in self.axis_names)
        return [int(r) for r in mesh[index].flatten().tolist()]

    # -- shorthands used by every layer -----------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.size()

    @property
    def tp_size(self) -> int:
        return self._sizes["tp"]

    @property
    def tp_rank(self) -> int:
        return self.rank("tp")

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def tp_depth(self) -> int:
        depth_axis = self.tp_grid.depth_axis
        return self._sizes[depth_axis] if depth_axis else 1

    @property
    def q(self) -> int:
        """Side of the tp grid: tp for 1d, q for 2d / 2.5d / 3d."""
        return self._sizes[self.tp_sub_axes[-1]]

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.rank("pp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def sp_size(self) -> int:
        return self.size("sp")

    @property
    def sp_rank(self) -> int:
        return self.rank("sp")

    @property
    def sp_group(self):
        return self.group("sp")

    @property
    def ep_size(self) -> int:
        return self.expert.sizes["ep"]

    @property
    def ep_rank(self) -> int:
        return self.expert.coord["ep"]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self._sizes[a]}" for a in ("dp", "pp", "sp", "tp"))
        sub = "x".join(str(self._sizes[a]) for a in self.tp_sub_axes)
        if self.ep_size > 1:
            sizes += f", ep={self.ep_size}"
        return f"ParallelMesh({sizes}, tp_mode={self.tp_mode!r} [{sub}], rank={dist.get_rank()})"


def default_device(mesh: ParallelMesh | None = None) -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _forget_dtensor_specs() -> None:
    """Drop DTensor's cached sharding propagations (its Python and C++ caches). They are keyed
    by DeviceMesh equality (ranks and dim names), so a later mesh equal to a closed one would
    get output specs that still hold the closed mesh, whose groups no longer resolve."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
