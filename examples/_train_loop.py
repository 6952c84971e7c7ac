"""Shared by the example scripts: command-line layout, mesh, one training step per schedule."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def layout_args(description: str) -> argparse.ArgumentParser:
    """--tp --tp-mode --tp-depth --pp --sp --dp --sp-mode --schedule --microbatches --steps ..."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tp-mode", default="1d", choices=["1d", "2d", "2.5d", "3d"])
    p.add_argument("--tp-depth", type=int, default=1, help="depth d of the 2.5d grid (tp = d*q*q)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp-mode", default="ring", choices=["ring", "ulysses"])
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--seed", type=int, default=0)
    return p


def world_of(args) -> int:
    return args.tp * args.pp * args.sp * args.dp


def make_mesh(args):
    from shardzoo import ParallelMesh

    return ParallelMesh(dp=args.dp, pp=args.pp, sp=args.sp, tp=args.tp, tp_mode=args.tp_mode,
                        tp_depth=args.tp_depth)


def train(args, mesh, model, batches, units_per_batch: int, unit: str) -> list[float]:
    """``args.steps`` AdamW steps of ``model`` (whole or this rank's stage) on ``batches(step)``
    -> (inputs [B, ...], targets), printing loss and throughput on rank 0. Returns the losses."""
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads
    from shardzoo.models.training import autocast, average_grads, clip_grad_norm_, data_parallel

    pipelined = mesh.pp_size > 1
    wrapped = model if pipelined else data_parallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = build_schedule([(mesh.pp_rank, model)], mesh, n_microbatches=args.microbatches,
                              schedule=args.schedule, loss_fn=model.loss) if pipelined else None
    losses = []
    for step in range(args.steps):
        inputs, targets = batches(step)
        inputs, targets = inputs.chunk(mesh.dp_size)[mesh.dp_rank], targets.chunk(mesh.dp_size)[mesh.dp_rank]
        start = time.perf_counter()
        opt.zero_grad()
        with autocast(args.bf16):
            if pipelined:
                mb: list[torch.Tensor] = []
                call = (model.shard_input(inputs),) if model.is_first else ()
                kwargs = dict(target=model.shard_target(targets), losses=mb) if model.is_last else {}
                schedule.step(*call, **kwargs)
                loss = torch.stack(mb).mean().float() if model.is_last else torch.zeros(())
            else:
                loss = model.loss(wrapped(model.shard_input(inputs)), model.shard_target(targets))
                loss.backward()
        if pipelined:
            sync_tied_grads([model], mesh)
            average_grads(model, mesh)
        norm = clip_grad_norm_(model, args.clip, mesh)
        opt.step()
        elapsed = time.perf_counter() - start
        value = loss.detach().float().clone()
        dist.all_reduce(value, group=mesh.group("dp", "sp"))
        if pipelined:  # the last stage holds the loss: send it to rank 0's printout
            dist.all_reduce(value, group=mesh.pp_group)
        value = value.item() / mesh.size("dp", "sp")
        losses.append(value)
        if dist.get_rank() == 0:
            rate = units_per_batch / elapsed
            print(f"step {step:3d}  loss {value:.4f}  grad-norm {norm.item():.3f}  {rate:,.0f} {unit}/s", flush=True)
    return losses
