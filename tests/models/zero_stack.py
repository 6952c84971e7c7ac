"""A tiny GPT-2 trained for a few AdamW steps under each ZeRO stage, and the per-rank functions
the ZeRO tests send to the pools (tests/models/test_zero*.py).

Every layout has dp=2 (3D: tp=1, the only cube that fits 8 ranks next to dp=2); each dp
replica feeds its own rows of the global batch, so the parallel run must equal the serial
model trained on the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardzoo.testing import cached_mesh

CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=37, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
# name -> (ParallelMesh kwargs, world size)
LAYOUTS = {
    "serial": (dict(), 1),
    "1d": (dict(dp=2, tp=2), 4),
    "2d": (dict(dp=2, tp=4, tp_mode="2d"), 8),
    "2.5d": (dict(dp=2, tp=4, tp_mode="2.5d", tp_depth=1), 8),
    "3d": (dict(dp=2, tp=1, tp_mode="3d"), 2),
    "1d_sp2": (dict(dp=2, sp=2, tp=2), 8),
    "1d_dp1": (dict(tp=2), 2),
    "pp2_dp2_tp2": (dict(pp=2, dp=2, tp=2), 8),
}
STEPS, LR, BATCH, SEQ = 3, 1e-2, 4, 8
# AdamW's eps: attention's key bias has an exactly zero gradient (softmax ignores a per-query
# constant), so in fp32 its gradient is summation noise (~1e-10) that the default eps=1e-8
# turns into steps of ~1e-2 lr, different for every summation order (serial vs two dp halves):
# an ill-conditioning of Adam, not of the sharding. eps=1e-5 keeps those steps below 1e-7.
EPS = 1e-5


def world_of(layout: str) -> int:
    return LAYOUTS[layout][1]


def mesh_of(layout: str):
    return cached_mesh(**LAYOUTS[layout][0])


def batch(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) [rows, SEQ] of step ``step``: the same global batch in every layout."""
    ids = torch.randint(0, CONFIG["vocab_size"], (rows, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def build(mesh, dtype=torch.float32, stage=None):
    from shardzoo.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(**CONFIG), mesh=mesh, seed=0, stage=stage)
    return model.to(dtype)


def dp_rows(t: torch.Tensor, mesh) -> torch.Tensor:
    return t.chunk(mesh.dp_size, 0)[mesh.dp_rank]


def step_loss(model, mesh, step: int, micro: int = 1) -> torch.Tensor:
    """Forward + backward of this dp replica's rows of step ``step``, in ``micro`` micro-batches
    (all but the last under ``no_sync``); returns the detached mean loss."""
    from shardzoo.parallel import no_sync

    inner = getattr(model, "module", model)  # DDP (zero 0 / 1)
    ids, target = (dp_rows(t, mesh) for t in batch(step))
    losses = []
    pieces = list(zip(ids.chunk(micro), target.chunk(micro)))
    for i, (x, y) in enumerate(pieces):
        def run():
            loss = inner.loss(model(inner.shard_input(x)), inner.shard_target(y)) / micro
            loss.backward()
            losses.append(loss.detach())
        if i < micro - 1:
            with no_sync(model):
                run()
        else:
            run()
    return torch.stack(losses).sum()


def train(layout: str, zero: int, dtype=torch.float32, steps: int = STEPS, clip: float | None = None,
          micro: int = 1, **options):
    """(model, optimizer) after ``steps`` AdamW steps of ``layout`` under ``zero``."""
    import shardzoo
    from shardzoo.models.training import clip_grad_norm_

    mesh = mesh_of(layout)
    model = shardzoo.data_parallel(build(mesh, dtype), mesh, zero=zero, **options)
    opt = shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS)
    for step in range(steps):
        opt.zero_grad()
        step_loss(model, mesh, step, micro)
        if clip is not None:
            clip_grad_norm_(getattr(model, "module", model), clip, mesh)
        opt.step()
    return model, opt


def full_weights(model) -> dict[str, torch.Tensor] | None:
    """``full_state_dict`` on every rank (collective); returned by global rank 0 only."""
    from shardzoo import full_state_dict

    state = full_state_dict(model)
    return state if dist.get_rank() == 0 else None


def trained_weights(layout: str, zeros: tuple[int, ...], dtype=torch.float32, **options) -> dict | None:
    """{zero: full weights after training} for each stage in ``zeros`` (rank 0; others None)."""
    out = {}
    for zero in zeros:
        model, _ = train(layout, zero, dtype, **options)
        out[zero] = full_weights(model)
    return out if dist.get_rank() == 0 else None
