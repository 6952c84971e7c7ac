"""Ulysses (DeepSpeed) sequence parallelism: trade the sequence shard for a head shard.

Each rank enters with [batch, heads, seq/P, head_dim] and an all-to-all gives it
[batch, heads/P, seq, head_dim]: whole sequences for a group of heads. Attention then runs
per head group with the same block kernel as ring attention (``shardzoo.kernels.flash_attention``,
no score matrix), and a second all-to-all restores the sequence shard. Four all-to-alls of
(P-1)/P of a q-sized tensor per rank in forward (q, k, v, out), the same four in backward,
independent of how many ranks there are; the price is heads % P == 0.

Layout: by default (``zigzag=None``) the shards are expected in the layout ring attention uses,
zigzag when ``causal`` and contiguous otherwise, so the two are interchangeable on the output of
``shard_sequence(x, group, dim=2, zigzag=causal)``. For causal attention over zigzag shards the
gathered sequence is put back into natural order before the kernel and returned to zigzag
order after it; ``zigzag=False`` takes contiguous causal shards. Non-causal attention does not
care about token order (the key padding mask is gathered in the same order as the keys).

Dropout on the probabilities runs in the kernel with the stateless mask of the global (batch,
head, query position, key position): after the all-to-all this rank's heads start at
``head_offset + rank * heads/P`` and the gathered tokens have the full-sequence positions (in
natural order, or zigzag order when the shards are zigzag and not reordered), so the mask is
the one single-rank attention draws with the same seed.
"""

from __future__ import annotations

import torch

from shardzoo.comm import all_to_all
from shardzoo.comm.ops import group_rank, group_size
from shardzoo.kernels import flash_attention
from shardzoo.kernels.flash_attention import draw_dropout_seed
from shardzoo.layers.sequence import from_zigzag_order, gather_padding_mask, to_zigzag_order


def _check_ulysses_inputs(q, k, v, key_padding_mask, world) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"ulysses_attention: {name} must be a [batch, heads, seq/P, head_dim] tensor, got {shape}")
    for name, t in (("q", q), ("k", k)):
        heads = t.shape[1]
        if heads % world != 0:
            raise ValueError(
                f"ulysses_attention: {name} has heads={heads}, which is not divisible by the sequence-parallel "
                f"size P={world}; Ulysses gives each rank heads/P whole heads. Use a head count that is a multiple "
                f"of {world} (repeat k/v heads for grouped-query attention), a smaller sp, or ring_attention, "
                "which has no constraint on heads"
            )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2])
    ):
        raise ValueError(
            f"ulysses_attention: key_padding_mask must be this rank's bool [batch, seq/P] = "
            f"{(k.shape[0], k.shape[2])} slice (True = attend), got {key_padding_mask.dtype} "
            f"{tuple(key_padding_mask.shape)}; shard it with shard_padding_mask(mask, group, zigzag=causal)"
        )


def ulysses_attention(q, k, v, *, group, causal=False, key_padding_mask=None, softmax_scale=None, zigzag=None,
                      dropout_p=0.0, dropout_seed=None, head_offset=0, batch_offset=0):
    """Exact attention over a sequence sharded across ``group``, by head-parallel all-to-all.

    Args:
        q, k, v: [batch, heads, seq/P, head_dim] this rank's shards; heads divisible by P.
        group: the sequence-parallel process group (e.g. ``mesh.sp_group``), P ranks.
        causal: causal attention over the global positions.
        key_padding_mask: this rank's bool [batch, seq/P] slice, True = attend.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        zigzag: whether the shards are zigzag (chunks r and 2P-1-r) rather than contiguous;
            None (default) means zigzag exactly when ``causal``, as ring attention expects.
        dropout_p, dropout_seed, head_offset, batch_offset: dropout on the probabilities, as
            in :func:`shardzoo.layers.ring_attention.ring_attention` (the same mask).

    Returns:
        [batch, heads, seq/P, head_dim] in q's dtype, this rank's rows (same layout as q).
    """
    world = group_size(group)
    _check_ulysses_inputs(q, k, v, key_padding_mask, world)
    # token order matters only to the causal mask: reorder zigzag shards only then
    reorder = causal and world > 1 and zigzag is not False
    if reorder and q.shape[2] % 2 != 0:
        raise ValueError(
            f"ulysses_attention: zigzag shards hold two equal chunks, but the local sequence length {q.shape[2]} "
            f"is odd; pad the full sequence to a multiple of 2*P = {2 * world}, or pass zigzag=False for "
            "contiguous shards"
        )
    # [B, H, S/P, D] -> [B, H/P, S, D]: heads scattered, sequence gathered
    q_heads, k_heads, v_heads = (all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    mask = None
    if key_padding_mask is not None:
        mask = gather_padding_mask(key_padding_mask, group, zigzag=reorder)
    if reorder:
        q_heads, k_heads, v_heads = (from_zigzag_order(t, world, 2) for t in (q_heads, k_heads, v_heads))
    drop = {}
    if dropout_p:
        seq, local_heads = q_heads.shape[2], q_heads.shape[1]
        positions = torch.arange(seq, device=q.device)
        if not reorder and world > 1 and (causal if zigzag is None else zigzag):
            if seq % (2 * world) != 0:
                raise ValueError(f"ulysses_attention: zigzag shards hold two equal chunks, but the local sequence "
                                 f"length {seq // world} is odd; pad the sequence to a multiple of {2 * world}")
            positions = to_zigzag_order(positions, world, 0)  # the gathered shards' token order
        drop = dict(dropout_p=dropout_p, dropout_seed=draw_dropout_seed() if dropout_seed is None else dropout_seed,
                    q_positions=positions, k_positions=positions, batch_offset=batch_offset,
                    head_offset=head_offset + group_rank(group) * local_heads)
    out = flash_attention(q_heads, k_heads, v_heads, causal=causal, key_padding_mask=mask, softmax_scale=softmax_scale,
                          **drop)
    if reorder:
        out = to_zigzag_order(out, world, 2)
    # [B, H/P, S, D] -> [B, H, S/P, D]
    return all_to_all(out, group, scatter_dim=2, gather_dim=1)
