"""Shared by the example scripts: command-line layout, mesh, stages, one training loop for
every schedule, and a one-line progress display."""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist


def layout_args(description: str) -> argparse.ArgumentParser:
    """--tp --tp-mode --tp-depth --pp --sp --dp --sp-mode --schedule --virtual --microbatches ..."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tp-mode", default="1d", choices=["1d", "2d", "2.5d", "3d"])
    p.add_argument("--tp-depth", type=int, default=1, help="depth d of the 2.5d grid (tp = d*q*q)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp-mode", default="ring", choices=["ring", "ulysses"])
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--virtual", type=int, default=2, help="stages per rank with --schedule interleaved")
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


def stages_of(args, mesh) -> list[tuple[int, tuple[int, int] | None]]:
    """(stage index, ``stage=`` argument) of each model this rank builds: the whole model, one
    stage, or ``--virtual`` stages ``pp_rank + i * pp`` for the interleaved schedule."""
    if mesh.pp_size == 1:
        return [(0, None)]
    virtual = args.virtual if args.schedule == "interleaved" else 1
    total = virtual * mesh.pp_size
    return [(mesh.pp_rank + i * mesh.pp_size, (mesh.pp_rank + i * mesh.pp_size, total)) for i in range(virtual)]


class Progress:
    """``step i/N  loss  grad-norm  rate`` on one line: rewritten in place on a terminal, one
    plain line per step otherwise (logs, pipes)."""

    def __init__(self, total: int, unit: str, stream=sys.stdout):
        self.total, self.unit, self.stream = total, unit, stream
        self.tty = stream.isatty()

    def update(self, step: int, loss: float, norm: float, rate: float) -> None:
        done = (step + 1) * 20 // self.total
        line = (f"step {step + 1:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (20 - done)}] "
                f"loss {loss:.4f}  grad-norm {norm:.3f}  {rate:,.0f} {self.unit}/s")
        end = "\n" if not self.tty or step + 1 == self.total else ""
        self.stream.write(("\r\x1b[2K" if self.tty else "") + line + end)
        self.stream.flush()


def train(args, mesh, build, batches, units_per_batch: int, unit: str) -> list[float]:
    """``args.steps`` AdamW steps of the models ``build(stage)`` makes for this rank (whole, one
    stage or interleaved virtual stages) on ``batches(step)`` -> (inputs [B, ...], targets),
    with a progress line on rank 0. Data parallelism (dp x sp) goes through
    ``shardzoo.data_parallel`` (torch DDP), also for pipeline stages. Returns the losses."""
    from shardzoo.comm.mesh import default_device
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads
    from shardzoo.models.training import autocast, clip_grad_norm_
    from shardzoo.parallel import data_parallel

    device = default_device(mesh)  # this rank's GPU under NCCL, else CPU
    stages = stages_of(args, mesh)
    models = [build(stage, device) for _, stage in stages]
    models = [data_parallel(m, mesh) for m in models]  # each stage wrapped in place
    first, last = models[0], models[-1]
    opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=args.lr)
    schedule = None
    if mesh.pp_size > 1:
        schedule = build_schedule([(i, m) for (i, _), m in zip(stages, models)], mesh,
                                  n_microbatches=args.microbatches, schedule=args.schedule, loss_fn=last.loss,
                                  device=device)
    progress = Progress(args.steps, unit) if dist.get_rank() == 0 else None
    losses = []
    for step in range(args.steps):
        inputs, targets = batches(step)
        inputs = inputs.chunk(mesh.dp_size)[mesh.dp_rank].to(device)
        targets = targets.chunk(mesh.dp_size)[mesh.dp_rank].to(device)
        start = time.perf_counter()
        opt.zero_grad()
        with autocast(args.bf16):
            if schedule is not None:
                mb: list[torch.Tensor] = []
                call = (first.shard_input(inputs),) if first.is_first else ()
                kwargs = dict(target=last.shard_target(targets), losses=mb) if last.is_last else {}
                schedule.step(*call, **kwargs)
                # each microbatch's loss is its share of the step's global mean
                loss = torch.stack(mb).sum().float() if last.is_last else torch.zeros((), device=device)
            else:
                loss = first.loss(first(first.shard_input(inputs)), first.shard_target(targets))
                loss.backward()
        sync_tied_grads(models, mesh)
        norm = clip_grad_norm_(models, args.clip, mesh)
        opt.step()
        value = loss.detach().float().clone()  # the global mean, the same on every rank of the last stage
        if schedule is not None:  # the last stage holds the loss: send it to rank 0's display
            dist.all_reduce(value, group=mesh.pp_group)
        value = value.item()
        elapsed = time.perf_counter() - start  # after reading the loss: the step is done on this rank
        losses.append(value)
        if progress is not None:
            progress.update(step, value, norm.item(), units_per_batch / elapsed)
    return losses
