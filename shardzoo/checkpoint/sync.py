"""The ranks taking part in a save or load, and how they agree on success or failure.

Every step that can fail on one rank (a bad file, a full disk, a mismatched model) is run under
:meth:`Ranks.agree`: each rank reports its error or None, and if any rank failed every rank
raises the same message. So one failing rank never leaves the others waiting in the next
collective; a rank that dies outright makes the others raise after the collective timeout.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from shardzoo.checkpoint.errors import CheckpointError


class Ranks:
    """The default process group when torch.distributed is initialised, else this process alone.

    Args:
        timeout: how long a barrier waits for a missing rank (the mesh's collective timeout).
    """

    def __init__(self, timeout: datetime.timedelta | None = None):
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1
        self.timeout = timeout

    def all_gather(self, obj) -> list:
        """``obj`` from every rank, in rank order."""
        if not self.active or self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.active or self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank; on gloo a rank that never arrives is named after the timeout."""
        if not self.active or self.world == 1:
            return
        if dist.get_backend() == "gloo" and self.timeout is not None:
            dist.monitored_barrier(timeout=self.timeout, wait_all_ranks=True)
        else:
            dist.barrier()

    def agree(self, error: str | None, what: str, payload=None) -> list:
        """Exchange (error, payload); raise CheckpointError on every rank if any rank failed.

        Returns the payloads of all ranks, in rank order."""
        replies = self.all_gather((error, payload))
        failed = [(r, e) for r, (e, _) in enumerate(replies) if e is not None]
        if failed:
            seen: dict[str, list[int]] = {}
            for r, e in failed:
                seen.setdefault(e, []).append(r)
            lines = [f"[rank {', '.join(map(str, rs))}] {e}" if self.world > 1 else e for e, rs in seen.items()]
            raise CheckpointError(f"{what} failed:\n" + "\n".join(lines))
        return [p for _, p in replies]


def describe(exc: BaseException) -> str:
    """A one-paragraph description of ``exc`` for :meth:`Ranks.agree`."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
