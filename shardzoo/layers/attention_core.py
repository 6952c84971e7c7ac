"""Attention of this rank's heads over a sequence sharded across the mesh's sp axis.

``sequence_attention`` picks the kernel: the block kernel (``shardzoo.kernels.flash_attention``)
when sp = 1, ring attention or Ulysses when sp > 1. Shards follow ``shard_sequence``: zigzag
(chunks r and 2P-1-r) for causal attention, contiguous otherwise.

Dropout on the attention probabilities needs the probabilities themselves, which the fused
kernels never form; with ``dropout_p > 0`` in training the reference path below computes
``softmax(q k^T) v`` explicitly for this rank's queries against the all-gathered keys
(memory O(S/P * S) per head), drawing the mask from the per-tp-rank stream
(``layers/random.py``). Eval, or ``dropout_p == 0``, always takes the fused path.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from shardzoo.comm import collectives as comm
from shardzoo.kernels import flash_attention
from shardzoo.layers import random
from shardzoo.layers.ring_attention import ring_attention
from shardzoo.layers.sequence import gather_padding_mask, to_zigzag_order
from shardzoo.layers.ulysses import ulysses_attention

SP_MODES = ("ring", "ulysses")


def local_positions(seq_local: int, mesh, zigzag: bool, device=None) -> torch.Tensor:
    """Global positions [seq_local] of this sp rank's tokens (contiguous or zigzag shard)."""
    world, rank = mesh.sp_size, mesh.sp_rank
    if not zigzag or world == 1:
        return torch.arange(rank * seq_local, (rank + 1) * seq_local, device=device)
    half = seq_local // 2
    first = torch.arange(rank * half, (rank + 1) * half, device=device)
    second = torch.arange((2 * world - 1 - rank) * half, (2 * world - rank) * half, device=device)
    return torch.cat([first, second])


def sequence_attention(q, k, v, *, mesh, causal: bool, key_padding_mask=None, softmax_scale=None,
                       sp_mode: str = "ring", dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """q, k, v: [B, h, S/P, d] (this rank's heads and sequence shard) -> [B, h, S/P, d].

    ``key_padding_mask``: bool [B, S/P] (True = attend), sharded like k."""
    if dropout_p > 0.0 and training:
        return _reference_attention(q, k, v, mesh, causal, key_padding_mask, softmax_scale, dropout_p)
    if mesh.sp_size == 1:
        return flash_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, softmax_scale=softmax_scale)
    if sp_mode == "ring":
        return ring_attention(q, k, v, group=mesh.sp_group, causal=causal, key_padding_mask=key_padding_mask,
                              softmax_scale=softmax_scale)
    return ulysses_attention(q, k, v, group=mesh.sp_group, causal=causal, key_padding_mask=key_padding_mask,
                             softmax_scale=softmax_scale)


def _reference_attention(q, k, v, mesh, causal, key_padding_mask, softmax_scale, dropout_p):
    """Explicit softmax(q k^T) with dropout, queries local, keys gathered over sp (in shard
    order, so key positions are the concatenated shard positions)."""
    world, seq_local = mesh.sp_size, q.shape[2]
    if world > 1:
        # all_gather's backward reduce-scatters: each shard's dK / dV summed over the ranks using it
        k, v = comm.all_gather(k, mesh.sp_group, 2), comm.all_gather(v, mesh.sp_group, 2)
        if key_padding_mask is not None:
            key_padding_mask = gather_padding_mask(key_padding_mask, mesh.sp_group, zigzag=False)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, h, S/P, S]
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)[None, None]
    if causal:
        q_pos = local_positions(seq_local, mesh, zigzag=True, device=q.device)
        k_pos = to_zigzag_order(torch.arange(seq_local * world, device=q.device), world, 0)
        allowed = allowed & (k_pos[None, :] <= q_pos[:, None])[None, None]
    if key_padding_mask is not None:
        allowed = allowed & rearrange(key_padding_mask, "b s -> b 1 1 s")
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: 0, as the kernels
    probs = random.dropout(probs, dropout_p, mesh=mesh, parallel_region=True, training=True)
    return torch.matmul(probs, v.float()).to(q.dtype)
