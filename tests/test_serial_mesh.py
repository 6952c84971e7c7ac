"""``ParallelMesh()`` with no launcher: a plain script (no torchrun, no shardzoo.launch) gets a
serial mesh on a one-process group the mesh starts itself, and runs a model on it; a mesh that
needs more processes still says how to start them."""

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from shardzoo import ParallelMesh

SCRIPT = """
import torch, torch.distributed as dist
import shardzoo
from shardzoo.models import GPT2, GPT2Config

assert not dist.is_initialized()
mesh = shardzoo.ParallelMesh()
model = GPT2(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16), mesh=mesh, seed=0)
ids = torch.randint(0, 64, (2, 8))
loss = model.loss(model(model.shard_input(ids)), labels=ids)
print(dist.get_world_size(), dist.get_backend(), mesh.coordinate, mesh.tp_size, bool(torch.isfinite(loss)))
print(shardzoo.ParallelMesh(dp=None).dp_size)  # a second mesh reuses the group
"""


def test_serial_mesh_without_a_launcher():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()[-2:]
    world, backend, *rest = first.split(" ", 2)
    assert world == "1" and backend in ("gloo", "nccl")
    assert rest[0].endswith("1 True") and "'dp': 0" in rest[0], first
    assert second == "1"


def test_larger_mesh_without_a_launcher_names_the_fix(monkeypatch):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"ParallelMesh\(sp=2, tp=2\) needs 4 processes and none were started.*"
                                           r"torchrun --nproc-per-node N .*shardzoo.launch"):
        ParallelMesh(sp=2, tp=2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # one of torchrun's processes whose group was not initialised
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 says this is one of 4 processes"):
        ParallelMesh()
    assert not dist.is_initialized()
