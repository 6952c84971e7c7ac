"""Sliding-window attention over a sequence sharded across sp (Mistral, Qwen2's
``use_sliding_window``): query at global position i sees the keys j with i - window < j
(and j <= i when causal), as transformers' ``sliding_window_overlay`` on its causal mask.

Every rank gathers the K / V shards of the sp group (only the kv heads travel; their gradient
is reduce-scattered back) and attends its own queries against the keys inside their window,
given by the global positions of both (zigzag or contiguous shards). Exact, in any sp_mode;
it holds the whole sequence's K / V, not one ring block: the ring's skipping of the blocks
outside the window is not built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardzoo.comm import collectives as comm
from shardzoo.comm import ops
from shardzoo.layers.sequence import shard_positions


def window_attention(q, k, v, *, group, window: int, causal: bool, zigzag: bool, key_padding_mask=None,
                     softmax_scale=None) -> torch.Tensor:
    """q [B, H, s, d], k / v [B, H_kv, s, d] this rank's heads and sequence shard ->
    [B, H, s, d]. ``key_padding_mask``: bool [B, s] (True = attend), sharded like k. Rows that
    see no key are 0."""
    world, rank, s = ops.group_size(group), ops.group_rank(group), q.shape[2]
    k_all, v_all = comm.all_gather(k, group, 2), comm.all_gather(v, group, 2)  # [B, H_kv, S, d]
    rep = q.shape[1] // k.shape[1]
    k_all, v_all = k_all.repeat_interleave(rep, 1), v_all.repeat_interleave(rep, 1)
    q_pos = shard_positions(s, rank, world, zigzag, q.device)
    k_pos = torch.cat([shard_positions(s, r, world, zigzag, q.device) for r in range(world)])
    seen = k_pos[None, :] > q_pos[:, None] - window  # [s, S]
    if causal:
        seen = seen & (k_pos[None, :] <= q_pos[:, None])
    seen = seen[None, None]
    if key_padding_mask is not None:
        seen = seen & ops.all_gather(key_padding_mask.contiguous(), group, 1)[:, None, None, :]
    empty = ~seen.any(-1, keepdim=True)  # [B or 1, 1, s, 1]: no key to see
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=seen | empty, scale=softmax_scale)
    return out.masked_fill(empty, 0.0)
