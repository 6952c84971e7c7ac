"""Paired timing of several implementations in one launch, on every rank of a process group:
build each (a failure is recorded, on every rank alike, and shown in the table), then run
``warmup + steps`` rounds, each implementation one step per round with a rotating first one so
drifts and order effects hit all alike (bench/parallelize.py, bench/experts.py)."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def first_line(e: BaseException) -> str:
    """An exception as one short line for a results table."""
    return f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]


def any_failed(failed: bool) -> bool:
    """True on every rank if any rank failed."""
    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def build_all(names: list[str], build: Callable[[str], object]) -> tuple[dict, dict]:
    """({name: build(name)} of those built on every rank, {name: error} of the others)."""
    impls, errors = {}, {}
    for name in names:
        err = None
        try:
            impls[name] = build(name)
        except Exception as e:  # noqa: BLE001  (recorded and shown in the table)
            err = first_line(e)
        if any_failed(err is not None):
            errors[name] = err or "failed on another rank"
            impls.pop(name, None)
    return impls, errors


def interleaved_steps(impls: dict, names: list[str], errors: dict, warmup: int, steps: int,
                      step: Callable[[str], float], label: str) -> tuple[dict, dict]:
    """Run the rounds: ``step(name)`` runs one training step of ``impls[name]`` and returns its
    loss; a step failing on any rank drops that implementation (its error recorded in
    ``errors``). Returns ({name: the timed steps' seconds, the slowest rank's}, {name: losses});
    rank 0 prints each step after ``label``."""
    times: dict = {n: [] for n in names}
    losses: dict = {n: [] for n in names}
    for i in range(warmup + steps):
        order = [n for n in names if n in impls]
        k = i % max(len(order), 1)
        for name in order[k:] + order[:k]:
            err = None
            dist.barrier()
            t0 = time.perf_counter()
            try:
                loss = step(name)
            except Exception as e:  # noqa: BLE001
                err = first_line(e)
            if any_failed(err is not None):
                errors[name] = f"step {i}: {err or 'failed on another rank'}"
                del impls[name]
                continue
            dist.barrier()
            seconds = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(seconds)
            losses[name].append(loss)
            if dist.get_rank() == 0:
                print(f"{label} step {i} {name}: {seconds:.2f} s loss {loss:.6f}", flush=True)
    for name in names:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        if len(slowest):
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[name] = slowest.tolist()
    return times, losses
