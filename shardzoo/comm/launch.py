"""``shardzoo.launch``: run a function on N local ranks, or on the ranks torchrun started.

Two ways to run the same script::

    def main(steps):
        mesh = shardzoo.ParallelMesh(tp=4, tp_mode="2d")
        ...
        return loss

    if __name__ == "__main__":
        losses = shardzoo.launch(main, 4, 10)   # python script.py  -> spawns 4 local ranks
                                               # torchrun --nproc-per-node 4 script.py -> uses them
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardzoo.comm.workers import WorkerPool, auto_backend, pickled_call


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting RANK etc.)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(backend: str = "auto", timeout: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment (idempotent)."""
    if dist.is_initialized():
        return
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # NCCL needs a GPU per rank of this node
    backend = auto_backend(local) if backend == "auto" else backend
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    # Tear the group down before the interpreter does: a rank exiting with live gloo
    # connections can abort a peer that is still shutting down.
    atexit.register(_destroy_at_exit)


def init_single_process(timeout: float | None = 600.0) -> None:
    """Start a one-process default group (world 1, rank 0) on an in-memory store, for a serial
    mesh in a notebook or a plain script: no launcher, no port, no environment variables.
    gloo, or NCCL on the current GPU when there is one (``auto_backend``)."""
    if dist.is_initialized():
        return
    backend = auto_backend(1)
    kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout is not None else {}
    dist.init_process_group(backend, store=dist.HashStore(), world_size=1, rank=0, **kwargs)
    atexit.register(_destroy_at_exit)


def _exiting_on_error() -> bool:
    """Whether the interpreter is exiting because of an uncaught exception (Python records it
    in ``sys.last_value`` / ``sys.last_exc`` before the atexit handlers run)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _destroy_at_exit() -> None:
    """At a normal exit, wait for every rank and destroy the group. After an uncaught error do
    not wait: a peer may be hung or dead (maybe the error's cause), and waiting would keep this
    process alive until the collective timeout, so the launcher (torchrun) would not see the
    failure and stop the job."""
    if not dist.is_initialized() or _exiting_on_error():
        return
    dist.barrier()
    dist.destroy_process_group()


class _Seeded:
    """``fn`` run after ``torch.manual_seed(seed)`` on each rank; named and shown as ``fn``, so
    the pool's errors and timeouts still name the user's function."""

    def __init__(self, fn: Callable[..., Any], seed: int):
        self.fn, self.seed = fn, seed
        self.__name__ = getattr(fn, "__name__", repr(fn))

    def __repr__(self) -> str:
        return repr(self.fn)

    def __call__(self, *args: Any) -> Any:
        torch.manual_seed(self.seed)
        return self.fn(*args)


def launch(
    fn: Callable[..., Any], nprocs: int, *args: Any, backend: str = "auto", timeout: float = 600.0,
    seed: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` ranks and return the per-rank results (rank order).

    Started plainly, it spawns ``nprocs`` local processes (gloo on CPU; NCCL when there are at
    least ``nprocs`` CUDA devices, one per rank), each with ``cores // nprocs`` threads, and a
    rendezvous port chosen by the OS. Under ``torchrun`` it runs ``fn`` in this process on the
    world torchrun made (which must have ``nprocs`` ranks) and gathers every rank's result.

    Args:
        fn: a module-level (picklable) function; its return values must pickle too.
        nprocs: number of ranks.
        backend: "auto", "gloo" or "nccl".
        timeout: seconds before ranks that have not finished are reported by rank (with their
            stacks) and killed; also the collective timeout (at least 30 s).
        seed: every rank runs ``torch.manual_seed(seed)`` before ``fn``, the same seed on all
            of them, as one seeded serial script would. Default: this process's
            ``torch.initial_seed()`` (``torch.manual_seed(s)`` before ``launch`` makes the ranks
            reproducible); under torchrun, rank 0's. ``fn`` may reseed as it likes; a
            ``ParallelMesh`` built afterwards aligns its tp x sp ranks again.

    Raises:
        The first rank's exception, with the rank and remote traceback attached;
        ``RankTimeoutError`` naming the ranks that hung; ``WorkerDiedError`` for a crashed rank.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be >= 1")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != nprocs:
            raise ValueError(
                f"launch(nprocs={nprocs}) but torchrun started WORLD_SIZE={world} ranks; "
                f"run `torchrun --nproc-per-node {nprocs}` or pass nprocs={world}"
            )
        init_from_env(backend, timeout)
        shared = [torch.initial_seed() if seed is None else seed]
        dist.broadcast_object_list(shared, src=0)
        result = _Seeded(fn, shared[0])(*args)
        results: list[Any] = [None] * world
        dist.all_gather_object(results, result)
        return results
    seeded = _Seeded(fn, torch.initial_seed() if seed is None else seed)
    pickled_call(seeded, args)  # an unpicklable function fails here, before any rank is spawned
    with WorkerPool(nprocs, backend=backend, timeout=timeout) as pool:
        return pool.run(seeded, *args)
