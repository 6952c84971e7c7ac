"""Ulysses (DeepSpeed) sequence parallelism: trade the sequence shard for a head shard.

Each rank enters with [batch, heads, seq/P, head_dim] and an all-to-all gives it
[batch, heads/P, seq, head_dim]: whole sequences for a group of heads. Attention then runs
per head group with the same block kernel as ring attention (``shardzoo.kernels.flash_attention``,
no score matrix), and a second all-to-all restores the sequence shard. Four all-to-alls of
(P-1)/P of a q-sized tensor per rank in forward (q, k, v, out), the same four in backward,
independent of how many ranks there are; the price is heads % P == 0.

Grouped-query attention (k, v with H_kv heads, H % H_kv == 0): each rank receives only the kv
heads its H/P query heads read: H_kv/P of them when P divides H_kv, else (H_kv divides P) the
one kv head its query heads share, which the all-to-all then carries once per rank that needs
it. Bytes per rank per all-to-all: (P-1)/P * B * S/P * d * bytes * (H for q and out,
P * max(H_kv/P, 1) for k and v).

Packed documents (``cu_seqlens`` / ``position_ids``): the shards follow the per-document split
(layers/packing.py); the gathered stream is put into natural order, each document attends on
its own, and the result goes back to the split before the second all-to-all.

Layout: by default (``zigzag=None``) the shards are expected in the layout ring attention uses,
zigzag when ``causal`` and contiguous otherwise, so the two are interchangeable on the output of
``shard_sequence(x, group, dim=2, zigzag=causal)``. For causal attention over zigzag shards the
gathered sequence is put back into natural order before the kernel and returned to zigzag
order after it; ``zigzag=False`` takes contiguous causal shards. Non-causal attention does not
care about token order (the key padding mask is gathered in the same order as the keys).

A sliding window (``window``, causal) is the kernel's own: after the all-to-all the rank holds
the whole sequence (each document whole) in natural order for its heads, so the window is a
plain band of the positions there (``flash_attention(window=...)``). Nothing is skipped but
what the kernel skips; on CUDA the windowed kernel is the torch reference (Triton has no window).

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
from shardzoo.layers.ring_attention import check_gqa_shapes, check_window, resolve_documents
from shardzoo.layers.ring_core import pad_to
from shardzoo.layers.sequence import from_zigzag_order, gather_padding_mask, to_zigzag_order


def _check_ulysses_inputs(q, k, key_padding_mask, world) -> None:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world != 0:
        raise ValueError(
            f"ulysses_attention: q has heads={heads}, which is not divisible by the sequence-parallel size "
            f"P={world}; Ulysses gives each rank heads/P whole heads. Use a head count that is a multiple of "
            f"{world}, a smaller sp, or ring_attention, which has no constraint on heads"
        )
    if kv_heads % world != 0 and world % kv_heads != 0:
        raise ValueError(
            f"ulysses_attention: k / v have {kv_heads} heads over P={world} ranks; Ulysses sends each rank H_kv/P "
            f"kv heads or, for fewer kv heads than ranks, one shared head, so H_kv must be a multiple or a divisor "
            f"of {world}. Use such a kv head count, a different sp, or ring_attention"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2])
    ):
        raise ValueError(
            f"ulysses_attention: key_padding_mask must be this rank's bool [batch, seq/P] = "
            f"{(k.shape[0], k.shape[2])} slice (True = attend), got {key_padding_mask.dtype} "
            f"{tuple(key_padding_mask.shape)}; shard it with shard_padding_mask(mask, group, zigzag=causal)"
        )


def kv_heads_per_rank(kv_heads: int, world: int) -> int:
    """kv heads each rank receives: H_kv/P, or the one shared head when H_kv < P."""
    return max(kv_heads // world, 1)


def _kv_to_heads(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """[B, H_kv, s, d] -> [B, kv_heads_per_rank, P*s, d]: each rank gets the kv heads its query
    heads read; with H_kv < P a head is sent once to every rank that needs it (the gradient of
    the selection sums the copies)."""
    kv_heads = t.shape[1]
    if kv_heads % world != 0:  # H_kv divides P: rank j's query heads all read kv head j*H_kv // P
        index = torch.tensor([j * kv_heads // world for j in range(world)], device=t.device)
        t = t.index_select(1, index)
    return all_to_all(t, group, scatter_dim=1, gather_dim=2)


def _attend_documents(q, k, v, split, causal, softmax_scale, drop, window=None):
    """Per-document attention over the natural-order sequence [B, h, S, d] (no cross-document
    block is ever formed), outputs concatenated."""
    outs, start = [], 0
    for length in split.lengths:
        part = slice(start, start + length)
        extra = {}
        if drop:
            positions = torch.arange(start, start + length, device=q.device)
            extra = dict(drop, q_positions=positions, k_positions=positions)
        outs.append(flash_attention(q[:, :, part], k[:, :, part], v[:, :, part], causal=causal,
                                    softmax_scale=softmax_scale, window=check_window("ulysses_attention", window,
                                                                                     causal, length), **extra))
        start += length
    return torch.cat(outs, 2)


def ulysses_attention(q, k, v, *, group, causal=False, cu_seqlens=None, key_padding_mask=None, softmax_scale=None,
                      zigzag=None, dropout_p=0.0, dropout_seed=None, head_offset=0, batch_offset=0,
                      position_ids=None, window=None):
    """Exact attention over a sequence sharded across ``group``, by head-parallel all-to-all.

    Args:
        q: [batch, heads, seq/P, head_dim] this rank's shard, heads divisible by P; k, v:
            [batch, kv_heads, seq/P, head_dim], heads % kv_heads == 0 and kv_heads a multiple
            or a divisor of P (grouped-query attention: query head h reads kv head
            h // (heads / kv_heads)).
        group: the sequence-parallel process group (e.g. ``mesh.sp_group``), P ranks.
        causal: causal attention over the global positions (within each document when packed).
        cu_seqlens: packed documents, int32 [docs + 1] offsets over the full sequence; shards
            from ``shard_sequence(x, group, dim=2, cu_seqlens=cu_seqlens)``.
        key_padding_mask: this rank's bool [batch, seq/P] slice, True = attend (dense only).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        zigzag: whether dense shards are zigzag (chunks r and 2P-1-r) rather than contiguous;
            None (default) means zigzag exactly when ``causal``, as ring attention expects.
        dropout_p, dropout_seed, head_offset, batch_offset: dropout on the probabilities, as
            in :func:`shardzoo.layers.ring_attention.ring_attention` (the same mask).
        position_ids: transformers' packed format instead of ``cu_seqlens``: the full [1, seq]
            position ids of the packed batch, restarting at 0 per document.
        window: a causal sliding window (transformers' ``sliding_window``, needs ``causal``):
            the query at position p sees the keys j with p - window < j <= p (within its
            document when packed), applied by the kernel on the gathered sequence.

    Returns:
        [batch, heads, seq/P, head_dim] in q's dtype, this rank's rows (same layout as q).
    """
    world = group_size(group)
    check_gqa_shapes("ulysses_attention", q, k, v)
    _check_ulysses_inputs(q, k, key_padding_mask, world)
    split = resolve_documents("ulysses_attention", cu_seqlens, position_ids, key_padding_mask, world,
                              group_rank(group), q.shape[2])
    window = check_window("ulysses_attention", window, bool(causal),
                          split.total if split is not None else world * q.shape[2])
    drop = {}
    if dropout_p:
        drop = dict(dropout_p=dropout_p, dropout_seed=draw_dropout_seed() if dropout_seed is None else dropout_seed,
                    batch_offset=batch_offset, head_offset=head_offset + group_rank(group) * (q.shape[1] // world))
    if split is not None:
        return _packed(q, k, v, group, world, split, causal, softmax_scale, drop, window)
    # token order matters only to the causal mask: reorder zigzag shards only then
    reorder = causal and world > 1 and zigzag is not False
    if reorder and q.shape[2] % 2 != 0:
        raise ValueError(
            f"ulysses_attention: zigzag shards hold two equal chunks, but the local sequence length {q.shape[2]} "
            f"is odd; pad the full sequence to a multiple of 2*P = {2 * world}, or pass zigzag=False for "
            "contiguous shards"
        )
    # [B, H, S/P, D] -> [B, H/P, S, D]: heads scattered, sequence gathered
    q_heads = all_to_all(q, group, scatter_dim=1, gather_dim=2)
    k_heads, v_heads = (_kv_to_heads(t, group, world) for t in (k, v))
    mask = None
    if key_padding_mask is not None:
        mask = gather_padding_mask(key_padding_mask, group, zigzag=reorder)
    if reorder:
        q_heads, k_heads, v_heads = (from_zigzag_order(t, world, 2) for t in (q_heads, k_heads, v_heads))
    if drop:
        seq = q_heads.shape[2]
        positions = torch.arange(seq, device=q.device)
        if not reorder and world > 1 and (causal if zigzag is None else zigzag):
            if seq % (2 * world) != 0:
                raise ValueError(f"ulysses_attention: zigzag shards hold two equal chunks, but the local sequence "
                                 f"length {seq // world} is odd; pad the sequence to a multiple of {2 * world}")
            positions = to_zigzag_order(positions, world, 0)  # the gathered shards' token order
        drop.update(q_positions=positions, k_positions=positions)
    groups = q_heads.shape[1] // k_heads.shape[1]
    k_heads, v_heads = (t.repeat_interleave(groups, 1) if groups > 1 else t for t in (k_heads, v_heads))
    # the causal sequence is in natural order here (zigzag shards reordered), so the window's
    # positions are the default arange
    out = flash_attention(q_heads, k_heads, v_heads, causal=causal, key_padding_mask=mask, softmax_scale=softmax_scale,
                          window=window, **drop)
    if reorder:
        out = to_zigzag_order(out, world, 2)
    # [B, H/P, S, D] -> [B, H, S/P, D]
    return all_to_all(out, group, scatter_dim=2, gather_dim=1)


def _packed(q, k, v, group, world, split, causal, softmax_scale, drop, window=None):
    """Packed documents: shards padded to the longest, all-to-all, natural order, per-document
    attention, back to the padded shards, all-to-all, padding dropped."""
    width, index = split.max_len, split.gather_index.to(q.device)
    q, k, v = pad_to([q, k, v], width, 2)
    q_heads = all_to_all(q, group, scatter_dim=1, gather_dim=2).index_select(2, index)
    k_heads, v_heads = (_kv_to_heads(t, group, world).index_select(2, index) for t in (k, v))
    groups = q_heads.shape[1] // k_heads.shape[1]
    k_heads, v_heads = (t.repeat_interleave(groups, 1) if groups > 1 else t for t in (k_heads, v_heads))
    out = _attend_documents(q_heads, k_heads, v_heads, split, causal, softmax_scale, drop, window)
    stream = out.new_zeros(out.shape[0], out.shape[1], world * width, out.shape[3]).index_copy(2, index, out)
    return all_to_all(stream, group, scatter_dim=2, gather_dim=1)[:, :, : split.local_len(group_rank(group))]
