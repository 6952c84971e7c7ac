"""Ranks that time-share a CPU host's cores: the host model of the ``cpu`` and ``calibrate``
presets (docs/planner.md, "Host models").

On such a host the ranks are processes on one machine. With more ranks than cores they split
the cores, a message waits until its receiver gets a core back (far longer than the link), a
rank idle in a pipeline bubble lends its core to the busy ones, and elementwise work slows down
with the tensor size: past a core's cache it streams from memory, and past the C library's
largest heap block each new tensor is mapped afresh and faults its pages in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Callable

from shardzoo.planner.host import DedicatedDevices

CACHE_BYTES = 1 << 20  # a CPU core's L2 here: larger operands stream from memory
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit hosts


@dataclass(frozen=True)
class TimeSharedCpu(DedicatedDevices):
    """A CPU host of ``cores`` cores whose ranks run one thread each.

    large_elementwise_bandwidth: bytes/s an elementwise kernel streams over tensors larger than
    ``cache_bytes`` (0: as ``Hardware.elementwise_bandwidth``); huge_elementwise_bandwidth: the
    same over tensors of ``mmap_threshold_bytes`` or more (0: as the large one);
    shared_latency_2x / _4x: seconds per message when each core runs 2 / 4 busy ranks, measured
    with ``shared_chunk`` seconds of single-core compute between messages (0: not measured, the
    link latency is scaled by ranks / cores); shared_latency_2x_long / _4x_long: the same with
    ``shared_chunk_long`` seconds between messages (0: not measured, the short figures serve for
    every chunk); module_call_seconds: the fixed CPU time of one module call of a training
    step, forward and backward, on one core (0: not measured)."""

    cores: int = 1
    large_elementwise_bandwidth: float = 0.0
    huge_elementwise_bandwidth: float = 0.0
    shared_latency_2x: float = 0.0
    shared_latency_4x: float = 0.0
    shared_chunk: float = 0.0
    shared_latency_2x_long: float = 0.0
    shared_latency_4x_long: float = 0.0
    shared_chunk_long: float = 0.0
    module_call_seconds: float = 0.0
    cache_bytes: int = CACHE_BYTES
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES

    kind = "time_shared_cpu"
    overlaps_backward = False  # priced as calibrated: the gradient reduction after backward
    default_dtype = "fp32"
    local_only = True  # the calibrated host is this machine: its ranks are local processes

    def dropout_mask_bytes(self, e: int) -> int:
        """On CPU F.dropout keeps the scaled noise tensor, in the activation dtype."""
        return e

    def rank_share(self, ranks_on_node: int) -> float:
        """The cores split between the ranks: a rank gets cores // ranks threads (at least one),
        or a fraction of a core when there are more ranks than cores."""
        if ranks_on_node >= self.cores:
            return self.cores / ranks_on_node
        return float(self.cores // ranks_on_node)

    def message_latency(self, latency: float, ranks_on_node: int, chunk: Callable[[], float | None]) -> float:
        """With more busy ranks than cores a message waits until the receiving rank gets a core
        back, and the wait grows with the compute the core's other ranks run meanwhile. In
        ranks per core: linear through the measured points (1, latency), (2, shared_latency_2x),
        (4, shared_latency_4x), and beyond the last one along its slope; in ``chunk()``: linear
        between the figures measured at ``shared_chunk`` and at ``shared_chunk_long`` (the
        ``_long`` points), held at the nearer one outside. Unmeasured points: latency * ranks /
        cores."""
        if ranks_on_node <= self.cores:
            return latency
        x = ranks_on_node / self.cores
        if not (self.shared_latency_2x and self.shared_latency_4x):
            return latency * x
        short = _along_ranks(x, latency, self.shared_latency_2x, self.shared_latency_4x)
        long_measured = self.shared_latency_2x_long and self.shared_latency_4x_long
        if not long_measured or self.shared_chunk_long <= self.shared_chunk:
            return short
        seconds = chunk()
        if seconds is None:
            return short
        long = _along_ranks(x, latency, self.shared_latency_2x_long, self.shared_latency_4x_long)
        f = min(1.0, max(0.0, (seconds - self.shared_chunk) / (self.shared_chunk_long - self.shared_chunk)))
        return short + f * (long - short)

    def pipeline_seconds(self, m: int, pp: int, reports) -> float:
        """A rank waiting in the bubble, or on a lighter stage, leaves its core to the others.
        The path then runs each stage at the most cores its ranks can hold (a whole core per
        rank, at most all the cores: ``t_k * max(share, 1 / pp)``), and the step is at least the
        work: every stage's m micro-batches at the shared speed spread over all cores,
        ``m * mean over the pp stages of t_k``. With a core or more per rank, as dedicated."""
        share = min(r.share for r in reports)
        if share >= 1:
            return super().pipeline_seconds(m, pp, reports)
        held = max(share, 1 / pp)  # a stage's time on the cores its ranks can hold, per shared time
        work = m * sum(r.micro_seconds * r.stages_alike for r in reports) / pp
        alone = [r.micro_seconds * held for r in reports]
        path = (m - 1) * max(alone) + sum(t * r.stages_alike for t, r in zip(alone, reports))
        return max(work, path)

    def module_seconds(self, calls: float) -> float:
        """On a CPU every op waits for its own Python, dispatch and autograd work: a fixed
        cost per module call, which a micro-batch of few rows cannot hide."""
        return calls * self.module_call_seconds

    def elementwise_classes(self, work: tuple[tuple[int, int], ...]) -> tuple[int, int, int]:
        """A pass over a tensor larger than ``cache_bytes`` is a large one; over one of
        ``mmap_threshold_bytes`` or more (glibc maps each new one afresh) a huge one too."""
        total = big = huge = 0
        for nbytes, n in work:
            total += n
            if nbytes > self.cache_bytes:
                big += n
                if nbytes >= self.mmap_threshold_bytes:
                    huge += n
        return total, big, huge

    def elementwise_bandwidths(self, hw) -> tuple[float, float, float]:
        small = hw.elementwise_bandwidth
        large = self.large_elementwise_bandwidth or small
        return small, large, self.huge_elementwise_bandwidth or large

    def to_json(self) -> dict:
        return {"kind": self.kind} | asdict(self)


def _along_ranks(x: float, latency: float, at_2x: float, at_4x: float) -> float:
    """Seconds per message at ``x`` ranks per core through (1, latency), (2, at_2x), (4, at_4x)."""
    if x <= 2:
        return latency + (x - 1) * (at_2x - latency)
    return max(latency, at_2x + (x - 2) * (at_4x - at_2x) / 2)


SHARED = ("shared_latency_2x", "shared_latency_4x", "shared_chunk", "shared_latency_2x_long",
          "shared_latency_4x_long", "shared_chunk_long")


def time_shared_cpu_from_json(data: dict, path: str, positive) -> TimeSharedCpu:
    """A TimeSharedCpu from a cache file's ``host`` object (untrusted: every field checked;
    ``positive(name, value, path)`` raises on a value that is not a positive finite number)."""
    names = {f.name for f in fields(TimeSharedCpu)}
    measured = {f.name for f in fields(TimeSharedCpu) if isinstance(f.default, float)}  # 0: not measured
    unknown = sorted(k for k in data if k not in names and k != "kind")
    if unknown:
        raise ValueError(f"{path}: unknown host fields {unknown}; delete the file and calibrate again")
    kwargs = {k: data[k] for k in names if k in data}
    for k, v in kwargs.items():
        if k in measured:
            if v == 0 and not isinstance(v, bool):
                continue  # 0: not measured
            positive(k, v, path)
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{path}: {k}={v!r} must be a positive integer; delete the file and calibrate again")
    return TimeSharedCpu(**kwargs)
