"""Model FLOPs of a training step, whatever the layout: what "model TFLOP/s per device" counts.

Narayanan et al. 2021 (eq. 3) count, per sequence of ``s`` tokens, the matmuls of every block
(``24 s h^2`` forward for a GPT block) and its attention scores and values over the whole
sequence (``4 s^2 h``, causal or not), three times (forward, and backward at twice the
forward) plus once more where activation recomputation runs the forward again, and the
logits (``2 s h V``) three times:

    F = B * ((3 + r) * l * (block matmuls + attention) + 3 * head matmuls)

with ``r`` = 1 under recomputation, else 0. For a GPT this is eq. 3, ``96 B s l h^2 (1 + s /
(6 h) + V / (16 l h))`` with recomputation; for any model it is 6 x (matmul parameters) x
tokens plus attention. The terms are read off the model's own pieces on one unsplit rank.
"""

from __future__ import annotations

from shardzoo.planner.block_costs import costs_of
from shardzoo.planner.model import Batch, assemble


def model_flops(shape, global_batch: int, seq: int, checkpointing: bool, e: int = 2, param_bytes: int = 4) -> float:
    """FLOPs of one training step of ``global_batch`` sequences of ``seq`` tokens (a model
    making its own sequence: its ``shape.tokens``), counted as above."""
    costs = costs_of("1d", 1, 1, param_bytes)
    cost = assemble(shape, shape.parts(costs, Batch(1, seq, 1, "ring", e, True, 1)))
    block, attention, _ = cost.block_work
    if shape.walk.causal:  # the pieces price a causal kernel's half; the formula counts the whole square
        attention *= 2
    head = cost.first.flops + cost.last.flops
    r = 1 if checkpointing else 0
    return float(global_batch) * ((3 + r) * shape.layers * (block + attention) + 3 * head)
