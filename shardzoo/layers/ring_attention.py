"""Ring attention: exact attention over a sequence sharded across a sequence-parallel group.

Each rank keeps its query shard and passes its K / V shard round a ring of the P ranks; every
step's visible part of the arriving block goes through the block kernel and is merged into the
running result by log-sum-exp (ring_core.py). Backward recomputes the blocks from the saved
global output and lse; dK / dV travel home with their block (ring_backward.py).

Shards: causal attention over a dense sequence expects zigzag shards (``shard_sequence(...,
zigzag=True)``: rank r holds chunks r and 2P-1-r, so every rank does the same work); packed
documents (``cu_seqlens`` or transformers' ``position_ids``) expect the per-document split of
``shard_sequence(..., cu_seqlens=...)``. Grouped-query attention: k, v have H_kv heads with
H % H_kv == 0, query head h reads kv head h // (H / H_kv); only the H_kv heads travel. A
sliding window (``window``) masks by global positions and skips the blocks wholly outside it
(ring_window.py). See docs/sequence_parallel.md.
"""

from __future__ import annotations

import torch

from shardzoo.comm.ops import group_rank, group_size
from shardzoo.kernels.flash_attention import draw_dropout_seed
from shardzoo.layers.packing import cu_seqlens_from_position_ids
from shardzoo.layers.ring_backward import ring_backward
from shardzoo.layers.ring_core import (  # noqa: F401  (re-exported: the ring's building blocks)
    CPU_GRAD_TILES,
    RingSettings,
    accumulation_dtype,
    merge_block,
    ring_blocks,
    ring_forward,
)
from shardzoo.layers.sequence import packed_split


class RingAttentionFunction(torch.autograd.Function):
    """Differentiable ring attention in q, k, v (the mask and settings get no gradient).
    Returns ``out``, or ``(out, lse)`` when ``settings.return_lse``; lse is differentiable too."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, settings):
        out, lse = ring_forward(q, k, v, key_padding_mask, settings)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.settings = settings
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero tensor to subtract
        return (out, lse) if settings.return_lse else out

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        if dout is None:  # only the lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, dlse, key_padding_mask, ctx.settings)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def check_gqa_shapes(who: str, q, k, v) -> None:
    """q [B, H, s, d], k / v [B, H_kv, s, d] with H % H_kv == 0, or a ValueError saying why."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name} must be a [batch, heads, seq/P, head_dim] tensor, got {shape}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"{who}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must agree on batch, "
                         "local sequence length and head_dim, and k, v must have one shape")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{who}: q has {q.shape[1]} heads and k / v {k.shape[1]}; grouped-query attention needs "
                         f"the query heads to be a multiple of the kv heads (H % H_kv == 0). Use a kv head count "
                         f"that divides {q.shape[1]}")


def resolve_documents(who: str, cu_seqlens, position_ids, key_padding_mask, world: int, rank: int, local_len: int):
    """The :class:`~shardzoo.layers.packing.DocumentSplit` of packed documents given either
    way, checked against this rank's shard; None for a dense sequence."""
    if position_ids is not None:
        if cu_seqlens is not None:
            raise ValueError(f"{who}: pass the document boundaries once, as cu_seqlens or as position_ids, not both")
        cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    if cu_seqlens is None:
        return None
    if key_padding_mask is not None:
        raise ValueError(f"{who}: packed documents (cu_seqlens / position_ids) take no key_padding_mask; drop the "
                         "padding tokens, or pack them as a document of their own")
    split = packed_split(cu_seqlens, world, who)
    if split.local_len(rank) != local_len:
        raise ValueError(f"{who}: rank {rank} holds {local_len} tokens, but the split of these {len(split.lengths)} "
                         f"documents ({split.total} tokens) over {world} ranks gives it {split.local_len(rank)}. Shard "
                         "q, k, v with shard_sequence(x, group, dim=2, cu_seqlens=cu_seqlens), and pass the full "
                         "packed position_ids [1, S] (or cu_seqlens), not this rank's slice")
    return split


def check_window(who: str, window, causal: bool, total: int) -> int | None:
    """The sliding window to apply: None when there is none or it covers the ``total`` tokens
    (every key of a causal row is inside it), else the int; a ValueError for a bad one."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{who}: window={window!r} must be an int >= 1 (transformers' sliding_window: the query at "
                         "position p sees the keys at p - window < j <= p), or None for no sliding window")
    if not causal:
        raise ValueError(f"{who}: window={window} is a causal sliding window (keys p - window < j <= p); pass "
                         "causal=True, or window=None for non-causal attention")
    return None if window >= total else window


def _check_dense(q, key_padding_mask, world, causal, zigzag) -> None:
    if causal and zigzag is False and world > 1:
        raise ValueError(
            "ring_attention: causal attention over P > 1 ranks needs zigzag shards, got zigzag=False; shard with "
            "shard_sequence(x, group, dim=2, zigzag=True), or use ulysses_attention(..., zigzag=False)"
        )
    if causal and world > 1 and q.shape[2] % 2 != 0:
        raise ValueError(
            f"ring_attention: causal attention uses zigzag shards of two equal chunks, but the local sequence "
            f"length {q.shape[2]} is odd; pad the full sequence to a multiple of 2*P = {2 * world} and shard it "
            "with shard_sequence(x, group, dim=2, zigzag=True), or pass cu_seqlens for packed documents"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (q.shape[0], q.shape[2])
    ):
        raise ValueError(
            f"ring_attention: key_padding_mask must be this rank's bool [batch, seq/P] = {(q.shape[0], q.shape[2])} "
            f"slice (True = attend), got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}; shard it with "
            "shard_padding_mask(mask, group, zigzag=causal)"
        )


def ring_attention(q, k, v, *, group, causal=False, cu_seqlens=None, return_lse=False, key_padding_mask=None,
                   softmax_scale=None, dropout_p=0.0, dropout_seed=None, head_offset=0, batch_offset=0, zigzag=None,
                   position_ids=None, grad_tiles=None, window=None):
    """Exact attention over a sequence sharded across ``group`` (ring attention).

    Args:
        q: [batch, heads, seq/P, head_dim] this rank's query shard; k, v: [batch, kv_heads,
            seq/P, head_dim] this rank's key / value shards, heads % kv_heads == 0
            (grouped-query attention: query head h reads kv head h // (heads / kv_heads)).
        group: the sequence-parallel process group (e.g. ``mesh.sp_group``), P ranks.
        causal: causal attention over the *global* positions (within each document when
            packed); a dense sequence must then be zigzag-sharded
            (``shard_sequence(x, group, dim=2, zigzag=True)``).
        cu_seqlens: packed documents, int32 [docs + 1] offsets over the full packed sequence
            (flash-attn varlen style), the same on every rank; the shards must come from
            ``shard_sequence(x, group, dim=2, cu_seqlens=cu_seqlens)``. Attention never crosses
            a document boundary; any lengths.
        return_lse: also return the log-sum-exp of the scaled scores, fp32 (fp64 for fp64)
            [batch, heads, seq/P] (-inf for rows that see no key), differentiable.
        key_padding_mask: this rank's bool [batch, seq/P] slice, True = attend (dense only).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        dropout_p: dropout on the attention probabilities, in [0, 1) (inside the block kernel;
            the caller decides training vs eval).
        dropout_seed: int seed of the stateless mask, the same on every rank of ``group``;
            None draws one from torch's default generator (equal on ranks seeded alike).
        head_offset, batch_offset: global index of the local first head / batch row (for the
            mask, when heads or batch are split over other mesh axes).
        zigzag: dense shard layout, for the mask's global positions; None means zigzag exactly
            when ``causal`` (causal over P > 1 ranks requires zigzag).
        position_ids: transformers' packed format instead of ``cu_seqlens``: the full
            [1, seq] position ids of the packed batch, restarting at 0 per document.
        grad_tiles: the schedule (docs/sequence_parallel.md, "The ring schedule"): n > 0 sends
            each 1/n of a K / V block round the ring on its own and computes it in row tiles
            (memory at the floor, more kernel calls); 0 sends whole blocks with the hops
            overlapped. None: 16 for CPU tensors, 0 for CUDA ones.
        window: a causal sliding window (transformers' ``sliding_window``, needs ``causal``):
            the query at global position p sees the keys j with p - window < j <= p (within its
            document when packed). The blocks are cut at the zigzag chunks; a (query chunk, key
            chunk) pair wholly outside every query's window is not computed (forward nor
            backward), one wholly inside runs unmasked, one the window cuts gets the window
            mask (on CUDA on the torch reference kernel). The K / V still make every hop.

    Returns:
        [batch, heads, seq/P, head_dim] in q's dtype, this rank's rows of the output (rows that
        see no key are 0); with ``return_lse`` the tuple (out, lse). K, V (and the mask) take
        P-1 hops in forward, dK / dV P hops in backward, each at the size of the longest shard
        with kv_heads heads. With dropout the result equals single-rank ``flash_attention``
        with the same seed on the gathered sequence.
    """
    check_gqa_shapes("ring_attention", q, k, v)
    if grad_tiles is None:
        grad_tiles = CPU_GRAD_TILES if q.device.type == "cpu" else 0
    elif isinstance(grad_tiles, bool) or not isinstance(grad_tiles, int) or grad_tiles < 0:
        raise ValueError(f"ring_attention: grad_tiles={grad_tiles!r} must be an int >= 0 (0: whole K / V blocks, "
                         f"hops overlapped; n > 0: 1/n chunks, memory at the floor) or None for the device's default")
    world = group_size(group)
    split = resolve_documents("ring_attention", cu_seqlens, position_ids, key_padding_mask, world,
                              group_rank(group), q.shape[2])
    if split is None:
        _check_dense(q, key_padding_mask, world, causal, zigzag)
    total = split.total if split is not None else world * q.shape[2]
    window = check_window("ring_attention", window, bool(causal), total)
    if dropout_p and dropout_seed is None:
        dropout_seed = draw_dropout_seed()
    settings = RingSettings(group, bool(causal), softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                            head_offset=head_offset, batch_offset=batch_offset,
                            zigzag=bool(causal) if zigzag is None else bool(zigzag),
                            grad_tiles=grad_tiles, split=split,
                            return_lse=bool(return_lse), window=window)
    return RingAttentionFunction.apply(q, k, v, key_padding_mask, settings)


__all__ = ["ring_attention", "RingAttentionFunction", "RingSettings", "merge_block", "ring_blocks",
           "accumulation_dtype", "CPU_GRAD_TILES", "check_gqa_shapes", "check_window", "resolve_documents"]
