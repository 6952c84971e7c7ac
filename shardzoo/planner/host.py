"""What the machine around the devices adds to their costs: the host model's interface.

The time and memory models ask the hardware's host model (``Hardware.host``) for these few
adjustments and hold no host-specific rule of their own. :class:`DedicatedDevices`, the model of
the accelerator presets, adds nothing: each rank owns its device, every message costs its link's
latency, a pipeline bubble idles its ranks and elementwise work streams at one bandwidth whatever
the tensor size. ``host_cpu.TimeSharedCpu`` (the ``cpu`` and ``calibrate`` presets) prices ranks
that time-share a CPU host's cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardzoo.planner.schedules import fill_fraction


@dataclass(frozen=True)
class DedicatedDevices:
    """No host effects: one device per rank (docs/planner.md, "Host models")."""

    kind = "dedicated"  # the name this model has in JSON
    default_dtype = "bf16"  # autocast, fp32 weights
    local_only = False  # ranks may span nodes: the launch line is torchrun's multi-node one

    def dropout_mask_bytes(self, e: int) -> int:
        """Bytes per element of a dropout mask: a bool tensor on accelerators."""
        return 1

    def rank_share(self, ranks_on_node: int) -> float:
        """Fraction of a device's speed one rank gets."""
        return 1.0

    def message_latency(self, latency: float, ranks_on_node: int, chunk: Callable[[], float | None]) -> float:
        """Seconds per message of a link of ``latency``; ``chunk()`` gives the longest compute
        (seconds on a whole device) a rank runs between two messages, for models where the
        wait depends on it."""
        return latency

    def pipeline_seconds(self, m: int, pp: int, reports, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
        """Forward and backward of m micro-batches through pp stages (``evaluate.StageReport``s,
        each standing for ``stages_alike`` stages): the slowest stage's m micro-batches plus one
        through each other stage, ``(m - 1) * max_k t_k + sum_k t_k``. Interleaved over v
        chunks per rank, the fill and drain pass chunks of 1 / v of a stage (Narayanan et al.
        2021, sec. 2.2.2): ``m * max_k t_k + (sum_k t_k - max_k t_k) / v``; the zero-bubble
        schedules fill them with deferred weight gradients (``schedules.fill_fraction``, with
        the slowest stage's F, B and W)."""
        slow = max(reports, key=lambda r: r.micro_seconds)
        slowest = slow.micro_seconds
        if virtual_stages == 1 and schedule in ("1f1b", "gpipe"):
            return (m - 1) * slowest + sum(r.micro_seconds * r.stages_alike for r in reports)
        rest = sum(r.micro_seconds * r.stages_alike for r in reports) - slowest
        w = slow.weight_seconds
        fill = fill_fraction(schedule, virtual_stages, slow.forward_seconds, slowest - slow.forward_seconds - w, w)
        return m * slowest + rest * fill

    # DDP all-reduces each gradient bucket as backward fills it, on its own stream
    overlaps_backward = True

    def exposed_reduction(self, seconds: float, calls: int, window: float) -> float:
        """Seconds of the gradient all-reduce (``seconds`` over ``calls`` buckets; DDP, ZeRO 0
        and 1) left after the backward it overlaps (``window``: the backward of the step's last
        micro-batch, where DDP syncs): all buckets but the last can hide under it."""
        if not self.overlaps_backward or calls == 0:
            return seconds
        return max(seconds / calls, seconds - window)

    def module_seconds(self, calls: float) -> float:
        """Fixed seconds (Python, dispatch, autograd) of ``calls`` module calls, forward and
        backward, whatever their size: none here, since an accelerator's kernel launches run
        ahead of its kernels."""
        return 0.0

    def elementwise_classes(self, work: tuple[tuple[int, int], ...]) -> tuple[int, int, int]:
        """(all, over large tensors, over huge ones) of ``work``'s elementwise passes, given as
        (tensor bytes, element passes) pairs: one class here."""
        return sum(n for _, n in work), 0, 0

    def elementwise_bandwidths(self, hw) -> tuple[float, float, float]:
        """Bytes/s of elementwise work over small, large and huge tensors on ``hw``."""
        bw = hw.elementwise_bandwidth
        return bw, bw, bw

    def to_json(self) -> dict:
        return {"kind": self.kind}


DEDICATED = DedicatedDevices()
