"""Communication accounting: how many bytes this rank sent, per op kind.

``with shardzoo.comm.count() as c:`` records every collective and p2p send issued by shardzoo
on this rank (forward and backward) while the block is open. Bytes are counted under the
bandwidth-optimal (ring) algorithm for each op, with ``n`` the payload in bytes and ``p`` the
group size; a group of size 1 sends nothing:

=============== =======================================================
op              bytes this rank sends
=============== =======================================================
all_reduce      2 (p-1)/p * n        (n = tensor size)
all_gather      (p-1)/p * n          (n = gathered output size)
reduce_scatter  (p-1)/p * n          (n = full input size)
all_to_all      (p-1)/p * n          (n = input size)
all_to_all_v    n                    (n = the rows sent to the other ranks; uneven splits)
broadcast       (p-1)/p * n          (pipelined chain, averaged over ranks)
reduce          (p-1)/p * n          (the chain in reverse; broadcast's adjoint)
send            n
=============== =======================================================

These are the same models the 2D / 2.5D / 3D papers use, so layer formulas can be compared
with the counts exactly (fractions are kept exact with ``fractions.Fraction``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterator

_BYTE_FACTOR = {
    "all_reduce": lambda p: Fraction(2 * (p - 1), p),
    "all_gather": lambda p: Fraction(p - 1, p),
    "reduce_scatter": lambda p: Fraction(p - 1, p),
    "all_to_all": lambda p: Fraction(p - 1, p),
    "all_to_all_v": lambda p: Fraction(1),
    "broadcast": lambda p: Fraction(p - 1, p),
    "reduce": lambda p: Fraction(p - 1, p),
    "send": lambda p: Fraction(1),
}


@dataclass
class CommRecord:
    """One communication call: its kind, payload bytes ``n`` and group size ``p``."""

    kind: str
    payload_bytes: int
    group_size: int

    @property
    def bytes_sent(self) -> Fraction:
        if self.group_size <= 1 and self.kind != "send":
            return Fraction(0)
        return _BYTE_FACTOR[self.kind](self.group_size) * self.payload_bytes


@dataclass
class CommCounter:
    """What ``count()`` yields: the records, and per-kind totals of bytes sent and calls."""

    records: list[CommRecord] = field(default_factory=list)

    @property
    def bytes(self) -> dict[str, Fraction]:
        """Bytes this rank sent, per op kind (exact fractions; ``int()`` them to print)."""
        totals: dict[str, Fraction] = defaultdict(Fraction)
        for r in self.records:
            totals[r.kind] += r.bytes_sent
        return dict(totals)

    @property
    def calls(self) -> dict[str, int]:
        """Number of calls per op kind, including no-op calls on groups of size 1."""
        totals: dict[str, int] = defaultdict(int)
        for r in self.records:
            totals[r.kind] += 1
        return dict(totals)

    @property
    def total_bytes(self) -> Fraction:
        return sum((r.bytes_sent for r in self.records), Fraction(0))


_lock = threading.Lock()
_active: list[CommCounter] = []


def record(kind: str, payload_bytes: int, group_size: int) -> None:
    """Add one call to every open counter (called by the ops in ``shardzoo.comm``)."""
    if not _active:
        return
    if kind not in _BYTE_FACTOR:
        raise ValueError(f"unknown communication kind {kind!r}; expected one of {sorted(_BYTE_FACTOR)}")
    rec = CommRecord(kind, int(payload_bytes), int(group_size))
    with _lock:
        for counter in _active:
            counter.records.append(rec)


@contextlib.contextmanager
def count() -> Iterator[CommCounter]:
    """Record the bytes this rank sends inside the block.

    Counters nest; backward passes run inside the block are counted too (autograd may run
    them on another thread, so the counter is process-wide, not thread-local).

    Example::

        with shardzoo.comm.count() as c:
            y = layer(x); y.sum().backward()
        print(c.bytes["all_reduce"], c.calls)
    """
    counter = CommCounter()
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
