"""ParallelMesh: sizes, coordinates and groups for every tp_mode, and every bad-input error."""

import pytest
import torch
import torch.distributed as dist

from shardzoo import ParallelMesh
from shardzoo.comm.mesh import tp_sub_shape
from shardzoo.layers import layout_of
from shardzoo.layers.sequence import gather_sequence, shard_sequence
from shardzoo.testing import run_on_ranks

LAYOUTS = [
    dict(tp=8, tp_mode="1d"),
    dict(dp=2, tp=4, tp_mode="1d"),
    dict(dp=2, pp=2, sp=2, tp=1),
    dict(dp=2, tp=4, tp_mode="2d"),
    dict(sp=2, tp=4, tp_mode="2d"),
    dict(tp=8, tp_mode="2.5d", tp_depth=2),
    dict(dp=2, tp=4, tp_mode="2.5d", tp_depth=1),
    dict(tp=8, tp_mode="3d"),
    dict(dp=None, tp=4, tp_mode="2d"),
]


def describe_mesh(layout):
    mesh = ParallelMesh(**layout)
    world, rank = dist.get_world_size(), dist.get_rank()
    info = {"coord": mesh.coordinate, "tp_rank": mesh.tp_rank, "sizes": {}, "groups": {}}
    for axes in [(a,) for a in mesh.axis_names] + [("tp",), ("dp", "sp"), mesh.tp_sub_axes[::-1]]:
        group = mesh.group(*axes)
        # The group really spans the ranks mesh.ranks() names, in that order.
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, rank, group=group)
        info["groups"][axes] = members
        assert members == mesh.ranks(*axes), (axes, members, mesh.ranks(*axes))
        assert dist.get_rank(group) == mesh.rank(*axes)
        info["sizes"][axes] = mesh.size(*axes)
    assert mesh.world_size == world
    mesh.close()  # a test process builds many meshes: release their groups
    return info


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_mesh_groups_and_coordinates(layout):
    infos = run_on_ranks(describe_mesh, 8, layout)
    mode = layout.get("tp_mode", "1d")
    tp = layout["tp"]
    for rank, info in enumerate(infos):
        # tp is the fastest-varying axis: a rank's tp coordinate is rank % tp.
        assert info["tp_rank"] == rank % tp
        assert info["groups"][("tp",)] == [rank - rank % tp + i for i in range(tp)]
        # Sub-axes are row-major inside tp: the last sub-axis varies fastest.
        sub = tp_sub_shape(tp, mode, layout.get("tp_depth", 1))
        coords = [info["coord"][a] for a in info["coord"] if a.startswith("tp")]
        flat = 0
        for c, s in zip(coords, sub):
            flat = flat * s + c
        assert flat == rank % tp
    # Every rank has a distinct coordinate.
    assert len({tuple(i["coord"].values()) for i in infos}) == 8


def test_mesh_inferred_axis():
    infos = run_on_ranks(describe_mesh, 4, dict(dp=None, tp=2))
    assert infos[0]["sizes"][("dp",)] == 2


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(dp=3, tp=2), "world size 4 != dp=3 * pp=1 * sp=1 * tp=2 = 6"),
        (dict(tp=4, tp_mode="2d", dp=None, pp=None), "only one of dp, pp, sp, tp may be None"),
        (dict(tp=2, tp_mode="2d", dp=2), "tp_mode='2d' needs tp to be a perfect square q*q; got tp=2"),
        (dict(tp=4, tp_mode="2.5d", tp_depth=2), "tp_mode='2.5d' needs tp = tp_depth*q*q; got tp=4, tp_depth=2"),
        (dict(tp=4, tp_mode="3d"), "tp_mode='3d' needs tp to be a perfect cube q*q*q; got tp=4"),
        (dict(tp=4, tp_mode="4d"), "unknown tp_mode='4d'; use one of 1d, 2d, 2.5d, 3d"),
        (dict(tp=4, tp_depth=2), "tp_depth=2 only applies to tp_mode='2.5d'"),
        (dict(dp=None, tp=3), "cannot infer dp: world size 4 is not divisible"),
        (dict(tp=0, dp=None), "tp=0 must be a positive integer"),
    ],
)
def test_mesh_bad_layout_errors(layout, message):
    with pytest.raises(ValueError) as info:
        run_on_ranks(_build, 4, layout)
    assert message in str(info.value)


def _build(layout):
    ParallelMesh(**layout)


def test_mesh_needs_initialised_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node N .*shardzoo.launch"):
        ParallelMesh(tp=2)


def test_unknown_axis_error():
    assert "unknown mesh axis 'tp_row' for tp_mode='1d'" in run_on_ranks(_unknown_axis, 2)[0]


def _unknown_axis():
    mesh = ParallelMesh(tp=2)
    try:
        mesh.group("tp_row")
    except ValueError as e:
        return str(e)


def two_meshes():
    """Two meshes in one process, different layouts, each with working groups."""
    a = ParallelMesh(tp=4, tp_mode="2d")
    b = ParallelMesh(dp=2, tp=2)
    x = torch.ones(1)
    dist.all_reduce(x, group=a.group("tp_row"))
    y = torch.ones(1)
    dist.all_reduce(y, group=b.dp_group)
    a.close()
    b.close()
    return x.item(), y.item(), a.size("tp_row"), b.dp_size


def test_two_meshes_coexist():
    assert run_on_ranks(two_meshes, 4) == [(2.0, 2.0, 2, 2)] * 4


def mesh_region_round_trip(layout, zigzag):
    mesh = ParallelMesh(**layout)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 12, generator=g, dtype=torch.float64)  # [batch, seq, hidden]
    tp_layout = layout_of(mesh)
    local = shard_sequence(tp_layout.shard_input(x), mesh.sp_group, 1, zigzag=zigzag)
    back = tp_layout.gather_output(gather_sequence(local, mesh.sp_group, 1, zigzag=zigzag))
    assert torch.equal(back, x)
    mesh.close()
    return tuple(local.shape)


@pytest.mark.parametrize(
    "layout, local_shape",
    [
        (dict(sp=2, tp=4, tp_mode="1d"), (4, 4, 12)),
        (dict(sp=2, tp=4, tp_mode="2d"), (2, 4, 6)),
        (dict(tp=8, tp_mode="2.5d", tp_depth=2), (1, 8, 6)),
        (dict(tp=8, tp_mode="3d"), (1, 8, 6)),
    ],
)
@pytest.mark.parametrize("zigzag", [False, True])
def test_mesh_shard_input_and_sequence_round_trip(layout, local_shape, zigzag):
    assert run_on_ranks(mesh_region_round_trip, 8, layout, zigzag) == [local_shape] * 8


def _gloo_threads() -> int:
    """Network threads of this process's gloo groups (one per group)."""
    import os

    count = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            count += f.read().strip() == "gloo_tcp_loop"
    return count


def close_releases_groups():
    import gc

    gc.collect()  # groups of earlier, closed meshes end with their last reference
    before = _gloo_threads()
    mesh = ParallelMesh(tp=8, tp_mode="3d")
    mesh.group("tp")  # a combined group too
    built = _gloo_threads()
    # a slice of the DeviceMesh that outlives the mesh, as torch's caches keep the meshes that
    # FSDP2 and DTensor were given: the groups must end all the same
    kept = mesh.device_mesh["tp_x"]
    mesh.close()
    del mesh
    gc.collect()
    after = _gloo_threads()
    del kept
    again = ParallelMesh(tp=8, tp_mode="3d")  # the same layout builds and works again
    x = torch.ones(1)
    dist.all_reduce(x, group=again.group("tp"))
    again.close()
    return before, built, after, x.item()


def test_close_destroys_the_mesh_groups():
    before, built, after, total = run_on_ranks(close_releases_groups, 8)[0]
    assert built > before, "building a mesh creates gloo groups"
    assert after == before, f"close() left {after - before} of the mesh's {built - before} gloo groups running"
    assert total == 8.0


def _bad_timeouts():
    import datetime

    messages = []
    for timeout in (-1, 0, 0.0, datetime.timedelta(0), datetime.timedelta(seconds=-5)):
        try:
            ParallelMesh(tp=2, timeout=timeout)
        except ValueError as e:
            messages.append(str(e))
    mesh = ParallelMesh(tp=2, timeout=30)  # nothing was left half-made: a valid mesh still works
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh.tp_group)
    mesh.close()
    return messages, float(total)


def test_non_positive_timeout_refused_before_any_group():
    for messages, total in run_on_ranks(_bad_timeouts, 2, timeout=120):
        assert len(messages) == 5 and all("the collective timeout must be positive" in m for m in messages), messages
        assert total == 2.0


def _dtensor_op_after_an_equal_mesh_closed():
    """A DTensor op on a closed mesh, then the same op on a new mesh whose "dp" DeviceMesh
    equals the old one (same ranks and name): the result must live on the new mesh."""
    from torch.distributed.tensor import DTensor, Shard

    old = ParallelMesh(dp=2)
    (DTensor.from_local(torch.ones(2), old.sub_mesh("dp"), [Shard(0)]) * 2).to_local()
    old.close()
    new = ParallelMesh(dp=2)
    out = DTensor.from_local(torch.ones(2), new.sub_mesh("dp"), [Shard(0)]) * 2
    # raised "Could not resolve the process group": a cached output spec held the old mesh
    same = out.device_mesh.get_group(0) is new.group("dp")
    new.close()
    return same


def test_closed_mesh_leaves_no_cached_dtensor_spec():
    assert all(run_on_ranks(_dtensor_op_after_an_equal_mesh_closed, 2))


_TORCHRUN_SCRIPT = """
import sys
import torch.distributed as dist
import shardzoo

mesh = shardzoo.ParallelMesh(tp=2)  # no launch(), no init_process_group: torchrun's environment only
sys.stdout.write(f"RANK {dist.get_rank()} TP {mesh.tp_rank} BACKEND {dist.get_backend()}\\n")
"""


def test_mesh_starts_the_group_under_torchrun_environment(tmp_path):
    """A script run as torchrun runs it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, no group
    yet) builds ParallelMesh(tp=2) directly: the mesh starts the default group itself (gloo on
    CPU), as shardzoo.launch does."""
    import os
    import socket
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        assert f"RANK {rank} TP {rank} BACKEND gloo" in out, out + err[-2000:]
