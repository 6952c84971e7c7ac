"""A small model in every layout, and the per-rank functions the checkpoint tests send to the pools.

The stack is embedding (vocab 13, padded on every mesh) -> LayerNorm -> Linear(8, 16) ->
GELU -> Linear(16, 8), built serially from a seed and converted with ``from_serial``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo import checkpoint
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import get_shard_spec
from shardzoo.testing import cached_mesh
from shardzoo.testing.meshes import with_world

VOCAB, HIDDEN, FFN = 13, 8, 16
CONFIG = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_size": FFN}
# name -> (ParallelMesh kwargs, world size); "serial" runs in the test process, no mesh
LAYOUTS = {
    "serial": (None, 1),
    "1d_tp2": with_world(tp=2),
    "1d_tp4": with_world(tp=4),
    "1d_dp2_tp2": with_world(dp=2, tp=2),
    "1d_pp2_tp2": with_world(pp=2, tp=2),  # stage 0: emb + ln, stage 1: fc1 + fc2
    "2d": with_world(tp=4, tp_mode="2d"),
    "2.5d": with_world(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d": with_world(tp=8, tp_mode="3d"),
}


class Stack(nn.Module):
    """embedding -> LayerNorm -> fc1 -> GELU -> fc2; forward for serial and 1D layouts.
    ids [b, s] -> [b, s, HIDDEN] (replicated)."""

    def __init__(self, emb, ln, fc1, fc2):
        super().__init__()
        self.emb, self.ln, self.fc1, self.fc2 = emb, ln, fc1, fc2

    def forward(self, ids):
        return self.fc2(F.gelu(self.fc1(self.ln(self.emb(ids)))))


def serial_stack(seed: int, dtype=torch.float32) -> Stack:
    """The serial model; every parameter random (LayerNorm too) so nothing loads by accident."""
    gen = torch.Generator().manual_seed(seed)
    model = Stack(nn.Embedding(VOCAB, HIDDEN, dtype=dtype), nn.LayerNorm(HIDDEN, dtype=dtype),
                  nn.Linear(HIDDEN, FFN, dtype=dtype), nn.Linear(FFN, HIDDEN, dtype=dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    return model


def _grid_classes(mode):
    from shardzoo.layers import (embedding_2d, embedding_2p5d, embedding_3d, linear_2d, linear_2p5d, linear_3d,
                                 norm_2d, norm_2p5d, norm_3d)

    return {
        "2d": (embedding_2d.VocabParallelEmbedding2D, norm_2d.LayerNorm2D, linear_2d.ParallelLinear2D),
        "2.5d": (embedding_2p5d.VocabParallelEmbedding2p5D, norm_2p5d.LayerNorm2p5D, linear_2p5d.ParallelLinear2p5D),
        "3d": (embedding_3d.VocabParallelEmbedding3D, norm_3d.LayerNorm3D, linear_3d.ParallelLinear3D),
    }[mode]


def build(layout: str, seed: int, dtype=torch.float32) -> Stack:
    """The stack in ``layout`` (a key of LAYOUTS), converted from ``serial_stack(seed)``."""
    serial = serial_stack(seed, dtype)
    if layout == "serial":
        return serial
    mesh = cached_mesh(**LAYOUTS[layout][0])
    if mesh.tp_mode == "1d":
        from shardzoo.layers.embedding_1d import VocabParallelEmbedding1D
        from shardzoo.layers.linear_1d import ParallelLinear1D
        from shardzoo.layers.norm_1d import LayerNorm1D

        if mesh.pp_size > 1 and mesh.pp_rank == 0:  # a pipeline stage keeps global names
            return Stack(VocabParallelEmbedding1D.from_serial(serial.emb, mesh), LayerNorm1D.from_serial(serial.ln, mesh),
                         nn.Identity(), nn.Identity())
        if mesh.pp_size > 1:
            return Stack(nn.Identity(), nn.Identity(), ParallelLinear1D.from_serial(serial.fc1, mesh, style="column"),
                         ParallelLinear1D.from_serial(serial.fc2, mesh, style="row"))
        return Stack(VocabParallelEmbedding1D.from_serial(serial.emb, mesh), LayerNorm1D.from_serial(serial.ln, mesh),
                     ParallelLinear1D.from_serial(serial.fc1, mesh, style="column"),
                     ParallelLinear1D.from_serial(serial.fc2, mesh, style="row"))
    emb_cls, norm_cls, linear_cls = _grid_classes(mesh.tp_mode)
    fc1 = linear_cls.from_serial(serial.fc1, mesh)
    fc2 = (linear_cls.from_serial(serial.fc2, mesh, input_placement=fc1.output_placement) if mesh.tp_mode == "3d"
           else linear_cls.from_serial(serial.fc2, mesh))
    return Stack(emb_cls.from_serial(serial.emb, mesh), norm_cls.from_serial(serial.ln, mesh), fc1, fc2)


def world_of(layout: str) -> int:
    """Number of ranks ``layout`` runs on (1 for "serial")."""
    return LAYOUTS[layout][1]


# -- per-rank functions ----------------------------------------------------------------------
def save_stack(layout: str, seed: int, ckpt_dir: str) -> bool:
    """Save the stack of ``seed`` built in ``layout`` to ``ckpt_dir`` (with CONFIG); True."""
    checkpoint.save(build(layout, seed), ckpt_dir, config=CONFIG)
    return True


def load_stack(layout: str, ckpt_dir: str, expected_seed: int) -> list[str]:
    """Load into a differently-initialised, garbage-filled model; compare bit-exactly with the
    serial model of ``expected_seed``; padding rows must come back zero. Returns the names
    this rank holds (a pipeline stage holds some)."""
    model = build(layout, seed=expected_seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    result = checkpoint.load(model, ckpt_dir)
    assert result == checkpoint.LoadResult([], []), result
    for name, p in model.named_parameters():
        spec = get_shard_spec(model, name)
        if spec is not None:
            outside = torch.ones_like(p, dtype=torch.bool)
            outside[spec.valid_local()] = False
            assert not p.detach()[outside].any(), f"{layout}: padding of {name} is not zero after load"
    state = full_state_dict(model) if layout != "serial" else model.state_dict()
    ref = serial_stack(expected_seed).state_dict()
    assert set(state) <= set(ref), (sorted(state), sorted(ref))
    for k, v in state.items():
        assert torch.equal(v, ref[k]), f"{layout}: {k} differs after load"
    return sorted(state)


def run(layout: str, fn, *args):
    """``fn(layout, *args)`` on the layout's ranks (in this process for "serial")."""
    from shardzoo.testing import run_on_ranks

    if layout == "serial":
        return [fn(layout, *args)]
    return run_on_ranks(fn, world_of(layout), layout, *args)


# -- training, for the optimizer resume test ------------------------------------------------
def batch(step: int) -> torch.Tensor:
    """Token ids [2, 3] of step ``step``, the same in every layout."""
    return torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: Stack, step: int) -> torch.Tensor:
    """Scalar mean of the squared output [2, 3, HIDDEN] on ``batch(step)``."""
    return model(batch(step)).pow(2).mean()


def train_step(model: Stack, opt, step: int) -> None:
    """One optimizer step on ``loss_of(model, step)``."""
    opt.zero_grad()
    loss_of(model, step).backward()
    opt.step()


def train_and_save(layout: str, ckpt_dir: str) -> float:
    """Two AdamW steps, save model + optimizer, then a third step; returns the loss after it
    (the run that did not stop)."""
    model = build(layout, 21, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        train_step(model, opt, step)
    checkpoint.save(model, ckpt_dir, opt, config=CONFIG)
    train_step(model, opt, 2)
    with torch.no_grad():
        return float(loss_of(model, 3))


def resume(layout: str, ckpt_dir: str) -> float:
    """A fresh model and optimizer (other init, other lr) loaded from the checkpoint, then the
    third step; returns the loss after it."""
    model = build(layout, 99, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    checkpoint.load(model, ckpt_dir, opt)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    assert float(opt.state[model.fc1.weight]["step"]) == 2.0
    train_step(model, opt, 2)
    with torch.no_grad():
        return float(loss_of(model, 3))


# -- failures --------------------------------------------------------------------------------
def save_failing_on(layout: str, seed: int, ckpt_dir: str, fail_rank: int) -> bool:
    """A save during which rank ``fail_rank`` raises after writing part of its shard."""
    import torch.distributed as dist

    from shardzoo.checkpoint import safetensors_io

    original = safetensors_io.SafetensorsWriter.write
    calls = []

    def write_then_fail(self, key, t):
        calls.append(key)
        if len(calls) == 2:
            raise OSError("simulated disk failure")
        return original(self, key, t)

    if dist.get_rank() == fail_rank:
        safetensors_io.SafetensorsWriter.write = write_then_fail
    try:
        checkpoint.save(build(layout, seed), ckpt_dir, config=CONFIG)
    finally:
        safetensors_io.SafetensorsWriter.write = original
    return True


def load_error(layout: str, ckpt_dir: str) -> str:
    """The CheckpointError message of loading ``ckpt_dir`` into ``layout``; "" when it loads."""
    try:
        checkpoint.load(build(layout, 0), ckpt_dir)
    except checkpoint.CheckpointError as e:
        return str(e)
    return ""


def load_outcome(layout: str, ckpt_dir: str, expected_seed: int, verify: bool) -> tuple[str, str]:
    """("error", message) when loading raises CheckpointError, else ("equal" | "DIFFERENT", "")
    comparing with the serial model of ``expected_seed``."""
    model = build(layout, seed=expected_seed + 1000)
    try:
        checkpoint.load(model, ckpt_dir, verify_checksums=verify)
    except checkpoint.CheckpointError as e:
        return "error", str(e)
    state = full_state_dict(model) if layout != "serial" else model.state_dict()
    ref = serial_stack(expected_seed).state_dict()
    return ("equal" if all(torch.equal(v, ref[k]) for k, v in state.items()) else "DIFFERENT"), ""


def tiny_gpt2_export(out_dir: str, ckpt_dir: str) -> bool:
    """On 2 ranks: a tiny GPT-2 saved (its own config recorded); rank 0 exports it as a
    Hugging Face directory."""
    import torch.distributed as dist

    from shardzoo.models.gpt2 import GPT2, GPT2Config

    model = GPT2(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2), mesh=cached_mesh(tp=2))
    checkpoint.save(model, ckpt_dir)
    if dist.get_rank() == 0:
        checkpoint.export_plain(ckpt_dir, out_dir, progress=False)
    dist.barrier()
    return True


def hf_load_error(hf_dir: str) -> str:
    """The CheckpointError message of ``GPT2.from_pretrained(hf_dir)`` on tp=2; "" when it loads."""
    from shardzoo.models.gpt2 import GPT2

    try:
        GPT2.from_pretrained(hf_dir, mesh=cached_mesh(tp=2))
    except checkpoint.CheckpointError as e:
        return str(e)
    return ""
