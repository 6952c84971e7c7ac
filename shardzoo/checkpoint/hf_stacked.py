"""Model tensors a Hugging Face directory stores as one tensor per expert.

transformers keeps a MoE layer's experts fused in memory (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]) but its ``save_pretrained`` writes one tensor per expert and
projection (Mixtral's ``experts.{e}.w1.weight`` [I, H], ``w3`` [I, H], ``w2`` [H, I]), and its
loader stacks them back: the per-expert tensors are stacked on a new dim 0, and the parts of
one expert (gate, then up) concatenated along one of their dims. A :class:`StackedSource` names
those file tensors; :func:`read_stacked` reads any box of the fused tensor from them, touching
only the experts (and parts) the box covers, so a rank reads its own experts' tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.tensors import Box


@dataclass(frozen=True)
class StackedSource:
    """The file tensors one fused model tensor [E, *part dims] is made of.

    Attributes:
        keys: ``keys[e][p]``: the checkpoint key of expert e's part p (parts in concatenation order).
        dim: the dim of a per-expert tensor along which its parts are concatenated.
    """

    keys: tuple[tuple[str, ...], ...]
    dim: int


def stacked_shape(weights, src: StackedSource) -> tuple[int, ...]:
    """The fused tensor's shape, [E, *an expert's parts concatenated]; raises CheckpointError
    naming the file tensor when the experts' parts disagree in shape."""
    first = [tuple(weights.shape(k)) for k in src.keys[0]]
    for e, keys in enumerate(src.keys):
        for key, want in zip(keys, first):
            got = tuple(weights.shape(key))
            if got != want:
                raise CheckpointError(f"{weights.hf_dir}: tensor {key} has shape {list(got)}, but expert 0's matching "
                                      f"tensor {src.keys[0][keys.index(key)]} has {list(want)}; every expert of a layer "
                                      f"must have the same shapes. The weight files do not belong together")
    dims = [len(s) for s in first]
    if len(set(dims)) != 1 or not 0 <= src.dim < dims[0] or \
            any(s[:src.dim] + s[src.dim + 1:] != first[0][:src.dim] + first[0][src.dim + 1:] for s in first):
        raise CheckpointError(f"{weights.hf_dir}: tensors {list(src.keys[0])} (shapes {[list(s) for s in first]}) cannot "
                              f"be concatenated along dim {src.dim} into one expert's weight")
    part = list(first[0])
    part[src.dim] = sum(s[src.dim] for s in first)
    return (len(src.keys), *part)


def read_stacked(weights, src: StackedSource, box: Box) -> torch.Tensor:
    """Box ``box`` (offsets, shape; dim 0 over experts) of the fused tensor, read from the
    per-expert file tensors it overlaps."""
    offsets, shape = box
    d = src.dim
    lo, hi = offsets[1 + d], offsets[1 + d] + shape[1 + d]
    experts = []
    for e in range(offsets[0], offsets[0] + shape[0]):
        parts, start = [], 0
        for key in src.keys[e]:
            size = weights.shape(key)[d]
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                sub_offsets = list(offsets[1:])
                sub_shape = list(shape[1:])
                sub_offsets[d], sub_shape[d] = a - start, b - a
                parts.append(weights.read(key, (tuple(sub_offsets), tuple(sub_shape))))
            start += size
        experts.append(torch.cat(parts, d))
    return torch.stack(experts, 0)
