"""ShardSpecs survive FSDP2: ``fully_shard`` on the dp axis replaces every parameter with a
DTensor, and ``full_state_dict`` still returns the serial tensors (gathered over dp, then over
tp by the spec kept on the owning module). A piece that does not fit its spec, or a sharded
module's parameter without one, is refused with the parameter's name, never returned in a
wrong shape; checkpoint save lists the rows of a DTensor parameter that this dp rank keeps."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardzoo.layers import (ParallelLinear1D, ParallelLinear2D, ParallelLinear2p5D, ParallelLinear3D,
                             VocabParallelEmbedding1D, VocabParallelEmbedding2D, VocabParallelEmbedding2p5D,
                             VocabParallelEmbedding3D)
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import ShardSpecError, get_shard_spec
from shardzoo.testing import cached_mesh, run_on_ranks
from shardzoo.testing.meshes import with_world

# name -> (ParallelMesh kwargs, world, linear class, vocab-parallel embedding class)
LAYOUTS = {
    "1d": (*with_world(dp=2, tp=2), ParallelLinear1D, VocabParallelEmbedding1D),
    "2d": (*with_world(dp=2, tp=4, tp_mode="2d"), ParallelLinear2D, VocabParallelEmbedding2D),
    "2.5d": (*with_world(dp=2, tp=4, tp_mode="2.5d", tp_depth=1), ParallelLinear2p5D, VocabParallelEmbedding2p5D),
    "2.5d_d2": (*with_world(tp=8, tp_mode="2.5d", tp_depth=2), ParallelLinear2p5D, VocabParallelEmbedding2p5D),
    "3d": (*with_world(tp=8, tp_mode="3d"), ParallelLinear3D, VocabParallelEmbedding3D),  # dp=1: 8 ranks at most
}


def _serial():
    torch.manual_seed(3)
    # vocabulary 13: uneven over every vocabulary split, so the padding rows are exercised
    return nn.ModuleDict({"fc": nn.Linear(16, 32), "wte": nn.Embedding(13, 16)})


def _parallel(name):
    kwargs, _, linear, vocab = LAYOUTS[name]
    mesh = cached_mesh(**kwargs)
    serial = _serial()
    par = nn.ModuleDict({"fc": linear.from_serial(serial["fc"], mesh), "wte": vocab.from_serial(serial["wte"], mesh)})
    return mesh, serial, par


def check_fully_shard(name):
    mesh, serial, par = _parallel(name)
    local_shapes = {n: tuple(p.shape) for n, p in par.named_parameters()}
    for module in par.values():
        fully_shard(module, mesh=mesh.device_mesh["dp"])
    for n, p in par.named_parameters():
        assert isinstance(p, DTensor), f"{name}: fully_shard left {n} a plain tensor"
        assert tuple(p.shape) == local_shapes[n] == get_shard_spec(par, n).local_shape
        assert tuple(p.to_local().shape) != local_shapes[n] or mesh.dp_size == 1  # split over dp
    state, ref = full_state_dict(par), serial.state_dict()
    assert state.keys() == ref.keys()
    for k, v in ref.items():
        assert not isinstance(state[k], DTensor)
        assert torch.equal(state[k], v), f"{name}: {k} after fully_shard differs from serial"
    return sorted(state)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_full_state_dict_after_fully_shard_equals_serial(name):
    assert len(set(map(tuple, run_on_ranks(check_fully_shard, LAYOUTS[name][1], name)))) == 1


def _error(fn, *args):
    try:
        fn(*args)
    except (ShardSpecError, ValueError) as e:
        return str(e)
    return None


def check_refusals():
    mesh, _, par = _parallel("1d")
    fc = par["fc"]
    out = {}
    # a piece of another shape than its spec (e.g. a wrapper that re-sliced the parameter)
    fc.weight = nn.Parameter(fc.weight.detach()[:, :8].clone())
    out["shape"] = _error(full_state_dict, par)
    # a sharded module's parameter replaced without its spec
    _, _, par = _parallel("1d")
    par["fc"].__dict__["_shard_specs"].pop("bias")
    out["missing"] = _error(full_state_dict, par)
    # checkpoint save of a DTensor parameter: this dp rank's rows of its tp piece
    from shardzoo.checkpoint.tensors import model_tensors

    _, _, par = _parallel("1d")
    fully_shard(par["fc"], mesh=mesh.device_mesh["dp"])
    tensors, _ = model_tensors(par)
    out["save"] = {lt.name: (tuple(lt.tensor.shape), lt.spec.global_shape) for lt in tensors if lt.name == "fc.weight"}
    return out


def test_mismatched_or_missing_spec_is_refused_by_name():
    for out in run_on_ranks(check_refusals, 4):
        assert out["shape"] is not None and "fc.weight has local shape (16, 8)" in out["shape"], out
        assert "ShardSpec says (16, 16)" in out["shape"] and "set_shard_spec" in out["shape"]
        assert out["missing"] is not None and "fc.bias has no ShardSpec" in out["missing"], out
        # column 16 -> 32 on tp=2: tp piece (16, 16); dp=2 keeps 8 of its rows per rank
        assert out["save"] == {"fc.weight": ((8, 16), (32, 16))}, out
