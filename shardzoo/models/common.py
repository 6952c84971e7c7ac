"""Pieces every model family shares: pipeline stage ranges, entering / leaving the mesh's
batch x sequence placement, loading full (serial) weights, renaming Hugging Face parameters.
The blocks themselves come from the mesh's layout object (layers/tensor_layout.py).

Token tensors (ids, masks, targets) ``[B, S]`` are split along the batch like the activations
of the layout (``TensorLayout.shard_batch``) and along the sequence over sp (zigzag order for
causal models, so ring attention is balanced).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardzoo.comm import ops
from shardzoo.layers.sequence import gather_sequence, to_zigzag_order
from shardzoo.layers.shard_spec import get_shard_spec
from shardzoo.layers.tensor_layout import layout_of


# -- pipeline stages -------------------------------------------------------------------------
def stage_blocks(who: str, num_blocks: int, stage: tuple[int, int] | None,
                 stage_layers: list[int] | None) -> tuple[range, bool, bool]:
    """(global block indices, holds the embeddings, holds the head) of one pipeline stage.

    ``stage=(k, n)``: stage k of n, blocks split evenly (the first ``num_blocks % n`` stages get
    one more); ``stage_layers``: blocks per stage, e.g. [3, 5]. Neither: the whole model."""
    if stage is None:
        if stage_layers is not None:
            raise ValueError(f"{who}: stage_layers={stage_layers} needs stage=(k, n) to say which stage to build")
        return range(num_blocks), True, True
    k, n = stage
    if not (isinstance(n, int) and n >= 1 and 0 <= k < n):
        raise ValueError(f"{who}: stage={stage} must be (k, n) with 0 <= k < n")
    if n > num_blocks:
        raise ValueError(f"{who} has {num_blocks} blocks and cannot be split into {n} pipeline stages (every stage "
                         f"needs at least one block); use pp <= {num_blocks} or a deeper model")
    if stage_layers is None:
        base, extra = divmod(num_blocks, n)
        stage_layers = [base + (1 if i < extra else 0) for i in range(n)]
    if len(stage_layers) != n or sum(stage_layers) != num_blocks or min(stage_layers) < 1:
        raise ValueError(f"{who}: stage_layers={stage_layers} must list {n} positive block counts summing to "
                         f"{num_blocks}")
    first = sum(stage_layers[:k])
    return range(first, first + stage_layers[k]), k == 0, k == n - 1


def check_seq_len(who: str, seq: int, max_positions: int, field: str) -> None:
    """Raise when a sequence is longer than the learned position table."""
    if seq > max_positions:
        raise ValueError(f"{who}: sequence length {seq} exceeds {field}={max_positions} (the learned position "
                         f"table); truncate the input to {max_positions} tokens or use a config with a larger {field}")


# -- tokens in and out ------------------------------------------------------------------------
def shard_tokens(t_full: torch.Tensor, mesh, placement, zigzag: bool) -> torch.Tensor:
    """[B, S, ...] ids / masks / targets -> this rank's [b, s, ...] (no gradient); ``placement``
    None: the batch stays whole."""
    t = t_full if placement is None else layout_of(mesh).shard_batch(t_full, placement)
    world = mesh.sp_size
    if world == 1:
        return t
    parts = 2 * world if zigzag else world
    if t.shape[1] % parts:
        raise ValueError(f"sequence length {t.shape[1]} is not divisible by {parts}, which "
                         f"{'zigzag' if zigzag else 'contiguous'} sharding over sp={world} needs; pad the sequence "
                         f"to a multiple of {parts} (padding mask False on the pad)")
    if zigzag:
        t = to_zigzag_order(t, world, 1)
    return ops.split_local(t, mesh.sp_group, 1)


def gather_tokens(y_local: torch.Tensor, mesh, placement, zigzag: bool) -> torch.Tensor:
    """Inverse of :func:`shard_tokens` for float outputs [b, s, ...] (differentiable)."""
    y = y_local if placement is None else layout_of(mesh).gather_batch(y_local, placement)
    return gather_sequence(y, mesh.sp_group, 1, zigzag=zigzag)


# -- weights ------------------------------------------------------------------------------------
@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Copy full-size (serial) tensors into this rank's pieces, through each ShardSpec.

    Only the parameters and buffers this stage holds are read; ``strict`` raises when one of
    them is missing from ``state``. Returns the names of ``state`` that were not used."""
    used = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in state:
            if strict:
                raise KeyError(f"load_full_state_dict: {name} is missing from the state dict")
            continue
        full = state[name].to(t.dtype)
        spec = get_shard_spec(model, name)
        t.copy_(spec.take(full) if spec is not None else full)
        used.add(name)
    return [n for n in state if n not in used]


def rename_block_param(name: str, pattern: re.Pattern, table: list[tuple[str, str]],
                       to_ours: bool) -> str | None:
    """Rename a per-block parameter between Hugging Face and shardzoo names.

    ``pattern`` matches ``<prefix>.<i>.<module>.<param>`` as groups (prefix.i, module, param);
    ``table`` lists (hf module, shardzoo module) pairs. Returns None when nothing matches."""
    m = pattern.match(name)
    if not m:
        return None
    for hf, ours in table:
        if m.group(2) == (hf if to_ours else ours):
            return f"{m.group(1)}.{ours if to_ours else hf}.{m.group(3)}"
    return None
