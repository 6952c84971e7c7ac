"""The expert axes of ParallelMesh: ep and edp groups split dp x sp, and the refusal of an ep
that does not divide it."""

import pytest
import torch.distributed as dist

from shardzoo import ParallelMesh
from shardzoo.testing import run_on_ranks

LAYOUTS = [dict(dp=4, ep=2), dict(dp=4, ep=4), dict(dp=2, sp=2, ep=2), dict(dp=2, sp=2, ep=4),
           dict(dp=2, tp=2, ep=2), dict(sp=2, pp=2, ep=1)]


def describe_expert_axes(layout):
    mesh = ParallelMesh(**layout)
    out = {"dp_sp": mesh.rank("dp", "sp"), "dp_sp_ranks": mesh.ranks("dp", "sp"), "ep_size": mesh.ep_size,
           "ep_rank": mesh.ep_rank}
    for axis in ("ep", "edp"):
        group = mesh.group(axis)
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, dist.get_rank(), group=group)
        assert members == mesh.ranks(axis), (axis, members, mesh.ranks(axis))
        assert dist.get_rank(group) == mesh.rank(axis) and len(members) == mesh.size(axis)
        out[axis] = members
    out["ep_tp"] = mesh.ranks("ep", "tp")
    mesh.close()
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_ep_groups_split_dp_sp(layout):
    infos = run_on_ranks(describe_expert_axes, 4, layout)
    ep = layout.get("ep", 1)
    for rank, info in enumerate(infos):
        assert info["ep_size"] == ep
        flat, group = info["dp_sp"], info["dp_sp_ranks"]
        # ep groups are ep consecutive ranks of dp x sp; edp the ranks at the same place of each
        start = flat - flat % ep
        assert info["ep"] == group[start:start + ep]
        assert info["edp"] == group[flat % ep::ep]
        assert info["ep_rank"] == flat % ep
        assert rank in info["ep"] and rank in info["edp"]
        assert set(info["ep"]) <= set(info["ep_tp"]) and len(info["ep_tp"]) == ep * layout.get("tp", 1)


def refuse(layout):
    with pytest.raises(ValueError) as err:
        ParallelMesh(**layout)
    return str(err.value)


def test_ep_not_dividing_dp_sp_is_refused_by_name():
    message = run_on_ranks(refuse, 4, dict(dp=2, tp=2, ep=4))[0]
    assert "ep=4" in message and "dp*sp = 2" in message and "use ep in [1, 2]" in message
    message = run_on_ranks(refuse, 4, dict(dp=4, ep=0))[0]
    assert "ep=0" in message and "positive integer" in message


def expert_axes_and_dp_refused(_):
    mesh = ParallelMesh(dp=4, ep=2)
    with pytest.raises(ValueError, match="do not combine with dp or sp"):
        mesh.group("ep", "dp")
    mesh.close()
    return True


def test_expert_axes_do_not_mix_with_dp():
    assert all(run_on_ranks(expert_axes_and_dp_refused, 4, 0))
