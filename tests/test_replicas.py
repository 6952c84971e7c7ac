"""Replicated parameters stay equal across tp ranks, and drift is caught: ParallelMesh aligns
the default RNG of each tp x sp group, checkpoint.save / full_state_dict(check_replicas=True)
compare every repeated piece by checksum, and SHARDZOO_DEBUG=1 compares the inputs given to
shard_input (shardzoo/layers/replicas.py)."""

import os

import pytest
import torch
import torch.distributed as dist

from shardzoo.layers.replicas import checksum
from shardzoo.testing import cached_mesh, run_on_ranks

CONFIG = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, resid_pdrop=0.1, embd_pdrop=0.1,
              attn_pdrop=0.1)


def draws_after_mesh(sync_rng):
    """Each rank seeded differently, then a dp=2 x tp=2 mesh: (default-stream draw, tp-stream
    draw) per rank."""
    from shardzoo import ParallelMesh
    from shardzoo.layers.rng_streams import tp_rng

    torch.manual_seed(100 + dist.get_rank())  # as unseeded ranks are: all different
    mesh = ParallelMesh(dp=2, tp=2, sync_rng=sync_rng)
    try:
        default = torch.rand(4)
        with tp_rng(mesh):
            tp = torch.rand(4)
        return default, tp
    finally:
        mesh.close()


def test_mesh_aligns_the_default_rng_of_tp_ranks_only():
    got = run_on_ranks(draws_after_mesh, 4, True)  # ranks 0, 1: dp 0; ranks 2, 3: dp 1
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[2][0], got[3][0])
    assert not torch.equal(got[0][0], got[2][0])  # dp replicas keep their own stream
    assert not torch.equal(got[0][1], got[1][1])  # the tp stream stays per tp rank
    unsynced = run_on_ranks(draws_after_mesh, 4, False)
    assert not torch.equal(unsynced[0][0], unsynced[1][0])


def train_and_check(case, ckpt_dir):
    """Two AdamW steps of a tiny GPT-2 with dropout 0.1 on tp=2, then checkpoint.save: the
    error message (None when it saved) and whether full_state_dict(check_replicas=True)
    raised. ``case``: "aligned" (ranks seeded differently, as unseeded ranks are, then a fresh
    ParallelMesh aligns them), "reseeded" (each rank reseeded differently after the mesh)."""
    from shardzoo import ParallelMesh, checkpoint, full_state_dict
    from shardzoo.layers.replicas import ReplicaMismatchError
    from shardzoo.models import GPT2, GPT2Config

    if case == "aligned":
        torch.manual_seed(1000 + dist.get_rank())
        mesh = ParallelMesh(tp=2)
    else:
        mesh = cached_mesh(tp=2)
        torch.manual_seed(dist.get_rank())
    model = GPT2(GPT2Config(**CONFIG), mesh=mesh)  # seeded from torch.initial_seed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 32, (2, 9), generator=rows)
        opt.zero_grad()
        model.loss(model(model.shard_input(ids[:, :-1])), model.shard_target(ids[:, 1:])).backward()
        opt.step()
    try:
        checkpoint.save(model, ckpt_dir)
        saved = None
    except checkpoint.CheckpointError as e:
        saved = str(e)
    try:
        full_state_dict(model, check_replicas=True)
        gathered = False
    except ReplicaMismatchError:
        gathered = True
    if case == "aligned":
        mesh.close()
    return saved, gathered


@pytest.mark.parametrize("case", ["aligned", "reseeded"])
def test_save_refuses_replicas_that_drifted(tmp_path, case):
    saved, gathered = run_on_ranks(train_and_check, 2, case, str(tmp_path / "ckpt"))[0]
    if case == "aligned":
        assert saved is None and not gathered
        return
    assert saved is not None and gathered
    assert "transformer.wpe.weight (replicated over tp)" in saved, saved  # a tp-replicated parameter, named
    assert "ranks [0] hold one copy; ranks [1] another" in saved, saved
    assert "seed every rank alike" in saved and "SHARDZOO_DEBUG=1" in saved, saved


def inputs_checked(same, debug):
    """shard_input on tp=2 with the same or per-rank ids: None, or the error it raised."""
    from shardzoo.layers.replicas import ReplicaMismatchError
    from shardzoo.models import GPT2, GPT2Config

    mesh = cached_mesh(tp=2)
    model = GPT2(GPT2Config(**CONFIG), mesh=mesh, seed=0)
    ids = torch.arange(8).reshape(1, 8) + (0 if same else dist.get_rank())
    os.environ["SHARDZOO_DEBUG"] = "1" if debug else "0"
    try:
        model.shard_input(ids)
        return None
    except ReplicaMismatchError as e:
        return str(e)
    finally:
        del os.environ["SHARDZOO_DEBUG"]


def test_debug_mode_checks_that_tp_ranks_get_the_same_input():
    assert run_on_ranks(inputs_checked, 2, True, True) == [None, None]
    errors = run_on_ranks(inputs_checked, 2, False, True)
    assert all(e and "GPT2.shard_input" in e and "ranks [0]; ranks [1]" in e for e in errors), errors
    assert run_on_ranks(inputs_checked, 2, False, False) == [None, None]  # off by default: no collective


def test_checksum_is_exact_and_position_sensitive():
    x = torch.randn(3000, dtype=torch.float32)
    y = x.clone()
    y[1234] = torch.nextafter(y[1234], torch.tensor(float("inf")))  # one ulp
    assert checksum(x) == checksum(x.clone()) and checksum(x) != checksum(y)
    assert checksum(x) != checksum(x.flip(0))
    assert checksum(torch.tensor([1, 2], dtype=torch.int8)) != checksum(torch.tensor([2, 1], dtype=torch.int8))
    assert checksum(x.to(torch.bfloat16)) == checksum(x.to(torch.bfloat16).clone())


def pipeline_copy_nudged(ckpt_dir):
    """pp=2 x tp=2: tp rank 1 of the last stage nudges its copy of ln_f.weight by one ulp;
    every rank's checkpoint.save error."""
    from shardzoo import checkpoint
    from shardzoo.models import GPT2, GPT2Config

    mesh = cached_mesh(pp=2, tp=2)
    model = GPT2(GPT2Config(**{**CONFIG, "n_layer": 2}), mesh=mesh, seed=0, stage=(mesh.pp_rank, mesh.pp_size))
    if model.is_last and mesh.tp_rank == 1:
        with torch.no_grad():
            w = model.transformer.ln_f.weight
            w[0] = torch.nextafter(w[0], torch.tensor(2.0))
    try:
        checkpoint.save(model, ckpt_dir)
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


def test_every_pipeline_stage_refuses_when_one_stage_drifted(tmp_path):
    errors = run_on_ranks(pipeline_copy_nudged, 4, str(tmp_path / "ckpt"))  # ranks 0, 1: stage 0
    assert all("differ on another pipeline stage" in e for e in errors[:2]), errors
    assert all("transformer.ln_f.weight (replicated over tp): ranks [2] hold one copy; ranks [3] another" in e
               for e in errors[2:]), errors
