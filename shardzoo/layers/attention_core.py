"""Attention of this rank's heads over a sequence sharded across the mesh's sp axis.

``sequence_attention`` picks the kernel: the block kernel (``shardzoo.kernels.flash_attention``)
when sp = 1, ring attention or Ulysses when sp > 1. Shards follow ``shard_sequence``: zigzag
(chunks r and 2P-1-r) for causal attention, contiguous otherwise.

Dropout on the attention probabilities runs inside the block kernel with a stateless mask, a
hash of (seed, global batch row, global head, global query position, global key position)
(``shardzoo/kernels/dropout_mask.py``). The seed is drawn once per call from torch's default
generator, which every tp and sp rank seeds alike (``layers/rng_streams.py``'s default stream), and
the caller passes the global index of its first head and batch row, so every layout of a tp x sp
mesh draws exactly the serial model's mask. Eval, or ``dropout_p == 0``, draws nothing.
"""

from __future__ import annotations

import torch

from shardzoo.kernels import flash_attention
from shardzoo.kernels.flash_attention import draw_dropout_seed
from shardzoo.layers.ring_attention import ring_attention
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.layers.ulysses import ulysses_attention

SP_MODES = ("ring", "ulysses")


def check_heads(who: str, hidden_size: int, num_heads: int, mesh, sp_mode: str = "ring") -> None:
    """Raise a message naming value, rule and fix unless the heads split over tp (the mesh's
    layout says over which axis) and, for Ulysses, each tp rank's heads over sp."""
    if hidden_size % num_heads != 0:
        raise ValueError(f"{who} needs hidden_size divisible by num_heads; got hidden_size={hidden_size}, "
                         f"num_heads={num_heads}. Choose num_heads that divides {hidden_size}")
    layout = layout_of(mesh)
    _, parts = layout.head_axis()
    if num_heads % parts != 0:
        raise ValueError(f"{who} needs num_heads divisible by {layout.head_rule()}; got num_heads={num_heads}. Use a "
                         f"head count that is a multiple of {parts} or a smaller tp")
    if sp_mode not in SP_MODES:
        raise ValueError(f"{who}: sp_mode={sp_mode!r} is not one of {SP_MODES}")
    local, sp = num_heads // parts, mesh.sp_size
    if sp_mode == "ulysses" and local % sp != 0:
        raise ValueError(f"{who}(sp_mode='ulysses') needs the heads per tp rank ({local}) divisible by sp={sp}; "
                         f"use sp_mode='ring', a smaller sp, or more heads")


def sequence_attention(q, k, v, *, mesh, causal: bool, key_padding_mask=None, softmax_scale=None,
                       sp_mode: str = "ring", dropout_p: float = 0.0, training: bool = False, head_offset: int = 0,
                       batch_offset: int = 0, cu_seqlens=None, zigzag: bool | None = None,
                       window: int | None = None) -> torch.Tensor:
    """q, k, v: [B, h, S/P, d] (this rank's heads and sequence shard) -> [B, h, S/P, d].

    ``key_padding_mask``: bool [B, S/P] (True = attend), sharded like k. ``dropout_p`` applies
    in training only; ``head_offset`` / ``batch_offset``: global index of the first local head
    / batch row (they select the dropout mask). ``cu_seqlens``: packed documents (int32
    offsets over the full sequence; shards from ``shard_sequence(..., cu_seqlens=...)``), run
    by ring attention or Ulysses also when sp = 1, since the block kernel alone has no documents.
    ``zigzag``: the dense shard layout (None: zigzag exactly when ``causal``); non-causal
    attention over zigzag shards (a causal model's encoder-style call) passes True, so the
    dropout mask sees the global positions. ``window``: a causal sliding window (the query at p
    sees the keys p - window < j <= p); the ring skips the blocks wholly outside it."""
    common = dict(causal=causal, key_padding_mask=key_padding_mask, softmax_scale=softmax_scale, window=window)
    if dropout_p > 0.0 and training:
        common.update(dropout_p=dropout_p, dropout_seed=draw_dropout_seed(), head_offset=head_offset,
                      batch_offset=batch_offset)
    if cu_seqlens is not None:
        common.update(cu_seqlens=cu_seqlens)
    elif mesh.sp_size == 1:
        return flash_attention(q, k, v, **common)
    elif zigzag is not None:
        common.update(zigzag=zigzag)
    if sp_mode == "ring":
        return ring_attention(q, k, v, group=mesh.sp_group, **common)
    return ulysses_attention(q, k, v, group=mesh.sp_group, **common)
