"""A pool of local processes that form one torch.distributed world and run functions on it.

Each worker initialises its process group once (gloo on CPU, NCCL with one GPU per rank), then
runs every function it is sent and returns the result. ``shardzoo.launch`` uses a pool once;
tests keep one pool per world size for the whole run, so a property-test example costs a
round trip, not a spawn.

Failures come back as the worker's own exception, with the rank and the remote traceback
attached; a rank that does not finish in time becomes a ``RankTimeoutError`` naming it, with
the stack it was stuck in. A pool that timed out, lost a worker or cannot pass a barrier after
an error is closed and must not be reused (``pool.healthy`` is False).
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

import torch
import torch.distributed as dist



_STARTUP_TIMEOUT_S = 300.0
_MIN_COLLECTIVE_TIMEOUT_S = 30.0


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of the re-raised error."""

    def __str__(self) -> str:
        return self.args[0]


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish in time. ``ranks`` lists them; the message shows their stacks."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class WorkerDiedError(RuntimeError):
    """A worker process exited (crash, kill, os._exit) while running a function."""


def auto_backend(nprocs: int) -> str:
    """NCCL when there is one CUDA device per rank, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def threads_per_rank(nprocs: int) -> int:
    """This machine's cores shared between the ranks: cores // nprocs, at least 1, and at most
    OMP_NUM_THREADS where that is set (so a run pinned to one thread stays on one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    threads = max(1, cores // nprocs)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(cap)) if cap.isdigit() and int(cap) > 0 else threads


def _worker_main(rank, world, port, backend, threads, timeout_s, stack_path, conn) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # Rendezvous happens while other ranks may still be importing torch, and a collective
    # timeout shorter than a connection setup is never useful: both get a floor.
    store_timeout = datetime.timedelta(seconds=max(timeout_s, _STARTUP_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=max(timeout_s, _MIN_COLLECTIVE_TIMEOUT_S))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=store_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    conn.send(("ready", None))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            break
        try:
            msg = pickle.loads(data)  # may import the function's module: seconds on a loaded host
        except BaseException as exc:  # noqa: BLE001 - an unimportable function is the caller's error
            conn.send_bytes(pickle.dumps(("error", (RuntimeError(f"cannot load the function: {exc!r}"),
                                                    traceback.format_exc()))))
            continue
        if msg is None:
            break
        conn.send_bytes(pickle.dumps(("loaded", None)))
        fn, args = msg
        try:
            reply = ("ok", fn(*args))
            payload = pickle.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            tb = traceback.format_exc()
            try:
                payload = pickle.dumps(("error", (exc, tb)))
            except Exception:  # the exception itself does not pickle
                payload = pickle.dumps(("error", (RuntimeError(f"{type(exc).__name__}: {exc}"), tb)))
        conn.send_bytes(payload)
    dist.destroy_process_group()
    stack_file.close()
    # Nothing is left to finalise: leave without the interpreter's teardown of torch's modules,
    # which takes a second or more per rank on a busy host while the pool's close waits for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pickled_call(fn: Callable[..., Any], args: tuple) -> bytes:
    """``(fn, args)`` pickled as the workers receive it; a clear error when it does not pickle."""
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"cannot send {fn!r} to the workers: {exc}. Pass a module-level function and "
            f"picklable arguments (no lambdas or local functions)"
        ) from exc


class WorkerPool:
    """``world_size`` local processes forming one torch.distributed world.

    Args:
        world_size: number of ranks.
        backend: "auto" (NCCL with one GPU per rank, else gloo), "gloo" or "nccl".
        timeout: seconds a function may run before its unfinished ranks are reported, and the
            collective timeout of the process group (at least 30 s).
        threads: intra-op threads per rank (default: cores // world_size, at least 1).
        error_grace: once a rank has failed, seconds the others get to report back before the
            pool is declared broken (they may be waiting in a collective for the failed rank).
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        timeout: float = 300.0,
        threads: int | None = None,
        error_grace: float = 10.0,
    ):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.backend = auto_backend(world_size) if backend == "auto" else backend
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r} must be 'auto', 'gloo' or 'nccl'")
        self.timeout = float(timeout)
        self.error_grace = float(error_grace)
        self.healthy = False
        self._stack_dir = tempfile.TemporaryDirectory(prefix="shardzoo-stacks-")
        # The parent owns the rendezvous store on a port the OS picked: no race for a free port.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        threads = threads or threads_per_rank(world_size)
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, self._store.port, self.backend, threads, self.timeout, self._stack_path(rank), child)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True, name=f"shardzoo-rank{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # Spawning and importing torch can take long on a loaded host: startup gets its own
        # allowance, so a short per-function timeout does not turn a slow start into a "hang".
        self._collect("start", max(self.timeout, _STARTUP_TIMEOUT_S))
        self.healthy = True

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir.name, f"rank{rank}.txt")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the per-rank results in rank order.

        ``fn`` and ``args`` must pickle (a module-level function). The first rank to fail
        re-raises here with its rank and remote traceback."""
        if not self.healthy:
            raise RuntimeError("this WorkerPool was closed after a failure or timeout; create a new one")
        payload = pickled_call(fn, args)
        name = getattr(fn, "__name__", repr(fn))
        self._send(payload, name)
        replies = self._collect(name, timeout or self.timeout)
        return [replies[r][1] for r in range(self.world_size)]

    def _send(self, payload: bytes, name: str) -> None:
        """Send a pickled (fn, args) to every rank and wait until each has loaded it: importing
        the function's module is startup, not the function, so it gets the startup allowance."""
        for conn in self._conns:
            conn.send_bytes(payload)
        # a rank that cannot load it leaves the others running it: the pool is not reusable
        self._collect(f"loading {name}", max(self.timeout, _STARTUP_TIMEOUT_S), check_after_error=False)

    def _collect(self, what: str, timeout: float, check_after_error: bool = True) -> dict[int, tuple]:
        replies: dict[int, tuple] = {}
        first_error: tuple[int, BaseException, str] | None = None
        deadline = time.monotonic() + timeout
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait_any(list(pending), timeout=left):
                rank = pending.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(1.0)
                    self.close(force=True)
                    raise WorkerDiedError(
                        f"rank {rank} exited with code {self._procs[rank].exitcode} while running {what}"
                    ) from None
                replies[rank] = (status, value)
                if status == "error" and first_error is None:
                    first_error = (rank, *value)
                    deadline = min(deadline, time.monotonic() + self.error_grace)
        if pending and first_error is None:
            hung = sorted(pending.values())
            stacks = self._dump_stacks(hung)
            self.close(force=True)
            done = sorted(replies) or "none"
            raise RankTimeoutError(
                f"rank(s) {hung} did not finish {what} within {timeout:.1f} s (finished: {done}); a rank "
                f"is stuck or a collective is waiting for a rank that never joined. Stacks:\n{stacks}",
                hung,
            )
        if first_error is not None:
            if pending or not check_after_error or not self._barrier_ok():
                self.close(force=True)
            rank, exc, tb = first_error
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on rank {rank} of {self.world_size} while running {what})")
            raise exc from RemoteTraceback(f"\n--- traceback on rank {rank} ---\n{tb}")
        return replies

    def _barrier_ok(self) -> bool:
        """After an error on every rank, check the world still works before reusing it."""
        try:
            self._send(pickle.dumps((dist.barrier, ())), "barrier")
            self._collect("barrier", min(self.timeout, 30.0), check_after_error=False)
            return True
        except Exception:
            return False

    def _dump_stacks(self, ranks: list[int]) -> str:
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)
        out = []
        for rank in ranks:
            try:
                with open(self._stack_path(rank)) as f:
                    text = f.read().strip()
            except FileNotFoundError:
                text = "(the rank had not finished starting up)"
            out.append(f"--- rank {rank} ---\n{text or '(no stack dumped)'}")
        return "\n".join(out)

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely unless ``force``). The pool cannot be used afterwards."""
        self.healthy = False
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + (0.0 if force else 5.0)
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._stack_dir.cleanup()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
