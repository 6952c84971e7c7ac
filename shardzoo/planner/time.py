"""Step time of a layout (docs/planner.md, "Time").

    t_stage   = flops / (F * efficiency * share) + sum over groups (bytes / bandwidth
                + messages * latency) / share + 4 * saved bytes / memory bandwidth
    t_step    = (m + pp - 1) * max over stages of t_stage   (GPipe and 1F1B: same bubble)
                + per-step communication (gradient reduction, tied table) + optimizer step

Placement: ranks are numbered dp, pp, sp, tp (tp fastest; the tp sub-axes slow to fast as in
ParallelMesh), so the tp and sp groups are the ones that stay inside a node. A group is inside a
node when ``devices_per_node`` is a multiple of its slowest axis' stride times that axis' size;
otherwise it is costed at the inter-node bandwidth and latency.
"""

from __future__ import annotations

from shardzoo.comm.mesh import _TP_SUB_AXES, tp_sub_shape
from shardzoo.planner.hardware import Hardware
from shardzoo.planner.model import ModelShape

ADAM_BYTES_PER_PARAM_BYTE = 7  # reads param, grad, two moments; writes param, two moments
MEMORY_PASSES = 4  # each saved activation byte is written and read again, forward and backward


def axis_strides(dp: int, pp: int, sp: int, tp: int, tp_mode: str, tp_depth: int) -> dict[str, tuple[int, int]]:
    """axis -> (stride in the global rank order, size)."""
    names = ("dp", "pp", "sp") + _TP_SUB_AXES[tp_mode]
    sizes = (dp, pp, sp) + tp_sub_shape(tp, tp_mode, tp_depth)
    out, stride = {}, 1
    for name, size in reversed(list(zip(names, sizes))):
        out[name] = (stride, size)
        stride *= size
    return out


def link(axes: tuple[str, ...], strides: dict[str, tuple[int, int]], hw: Hardware) -> tuple[float, float]:
    """(bandwidth, latency) of the group spanning ``axes``."""
    slowest = max((strides[a] for a in axes), key=lambda s: s[0])
    inside = hw.devices_per_node % (slowest[0] * slowest[1]) == 0
    return (hw.intra_bandwidth, hw.intra_latency) if inside else (hw.inter_bandwidth, hw.inter_latency)


class Links:
    """(bandwidth, latency) per group of one layout, looked up once per group."""

    def __init__(self, strides: dict[str, tuple[int, int]], hw: Hardware):
        self.strides, self.hw, self._cache = strides, hw, {}

    def seconds(self, traffic) -> float:
        """Seconds to send ``traffic`` (a comm.Traffic) at each group's link."""
        total, cache = 0.0, self._cache
        for axes, n, messages in traffic.links():
            lk = cache.get(axes)
            if lk is None:
                lk = cache[axes] = link(axes, self.strides, self.hw)
            total += n / lk[0] + messages * lk[1]
        return total


def block_flops(shape: ModelShape, tokens: int, seq: int) -> float:
    """Forward FLOPs of one block over ``tokens`` tokens that attend to ``seq`` keys: the
    matmuls (q, k, v, out, fc1, fc2) and the attention scores and values (half when causal)."""
    h, f = shape.hidden, shape.ffn
    attention = 4 * tokens * seq * h * (0.5 if shape.causal else 1.0)
    return 2 * tokens * (4 * h * h + 2 * h * f) + attention


def end_flops(shape: ModelShape, tokens: int, rows: int, first: bool, last: bool) -> float:
    """Forward FLOPs of the embeddings (ViT's patch projection; lookups cost none) and the head
    (the logits matmul, or ViT's classifier) over this rank's ``tokens`` / ``rows``."""
    c = shape.config
    if shape.family != "vit":
        return 2 * tokens * shape.hidden * shape.vocab if last else 0.0
    patches = (c.image_size // c.patch_size) ** 2
    out = 2 * rows * patches * c.num_channels * c.patch_size**2 * shape.hidden if first else 0.0
    return out + (2 * rows * shape.hidden * c.num_labels if last else 0.0)
