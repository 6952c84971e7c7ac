"""Ring attention: exact attention over a sequence sharded across a sequence-parallel group.

Three pieces (DESIGN principle 6):

* a block kernel, :func:`shardzoo.kernels.attention_block_forward` / ``_backward``, returning
  ``(out, lse)`` for one query block against one key block, without a score matrix;
* a ring iterator, :func:`ring_blocks`, that hands each rank every K/V block of the group in
  turn while the next block is already on its way (async p2p overlapping the compute);
* a merge, :func:`merge_block`, folding each block's ``(out, lse)`` into the running result in
  fp32 by log-sum-exp.

Backward recomputes each block from the saved global output and lse; dK / dV travel round the
ring with their K / V block and arrive home after P steps, dQ accumulates locally.

Causal attention expects zigzag-sharded inputs (``shard_sequence(..., zigzag=True)``): rank r
holds sequence chunks r and 2P-1-r, and :func:`block_schedule` picks per step which part of the
block is needed, so every rank does the same work. Non-causal attention takes any sharding
whose K, V and mask agree (contiguous by convention). See docs/sequence_parallel.md.

Dropout on the probabilities runs inside the block kernel with a stateless mask of the global
(batch, head, query position, key position): each block gets the global positions of its query
rows and key columns (:func:`shard_positions` of this rank and of the source rank, sliced like
the block), so the ring draws exactly the mask of single-rank attention with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from shardzoo.comm import RingExchange
from shardzoo.comm.ops import group_rank, group_size
from shardzoo.kernels import attention_block_backward, attention_block_forward
from shardzoo.kernels.flash_attention import draw_dropout_seed
from shardzoo.layers.sequence import shard_positions

_ALL = slice(None)
CPU_GRAD_TILES = 4  # on CPU a block's backward runs as (up to) 4 x 4 tiles into the arriving dK / dV


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other dtype merges and accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's softmax result into the running one, in place.

    out [B, H, S, D] and lse [B, H, S] are the running result (fp32 / fp64, may be views);
    block_out / block_lse come from the block kernel for the same rows. With
    w = sigmoid(block_lse - lse), the share of the block in the merged softmax::

        out <- out - w * (out - block_out)
        lse <- lse - logsigmoid(lse - block_lse)

    which is log-sum-exp merging without exponentiating large numbers. Rows where a side saw
    no key (lse = -inf) take the other side unchanged.
    """
    block_lse = block_lse.to(lse.dtype)
    nothing_yet = torch.isneginf(lse)
    block_empty = torch.isneginf(block_lse)
    special = nothing_yet | block_empty
    # -inf - (-inf) would be nan: give special rows a harmless difference, fix them below
    diff = torch.where(special, torch.zeros_like(lse), block_lse - lse)
    weight = torch.sigmoid(diff)
    weight = torch.where(block_empty, torch.zeros_like(weight), weight)
    weight = torch.where(nothing_yet, torch.ones_like(weight), weight)
    merged_lse = torch.where(special, torch.maximum(lse, block_lse), lse - F.logsigmoid(-diff))
    out.lerp_(block_out.to(out.dtype), weight[..., None])  # out + w * (block_out - out), no temporary
    lse.copy_(merged_lse)


def ring_blocks(group, tensors: list[torch.Tensor]) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
    """Yield ``(step, source_rank, tensors)`` for the P steps of a ring over ``group``.

    At step s this rank holds the ``tensors`` that group rank ``(rank - s) % P`` started with.
    The exchange for step s+1 is started before step s is yielded, so the caller's compute
    overlaps the transfer; P-1 exchanges in all (nothing is sent after the last step)."""
    ring = RingExchange(group)
    me = group_rank(group)
    for step in range(ring.size):
        pending = ring.start(tensors) if step < ring.size - 1 else None
        yield step, (me - step) % ring.size, tensors
        if pending is not None:
            tensors = pending.wait()


def block_schedule(step: int, rank: int, source: int, local_len: int, causal: bool) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) this rank computes against the block of ``source``.

    Non-causal: everything. Causal with zigzag shards (this rank holds chunks r, 2P-1-r; the
    source holds chunks s, 2P-1-s):

    * step 0 (own block): all queries vs all keys, causal (local order is global order);
    * source < rank: every query comes after chunk s and before chunk 2P-1-s, so all queries
      vs the source's first chunk, fully visible;
    * source > rank: only the second query chunk (2P-1-r) comes after both source chunks, so
      the second half of the queries vs all source keys, fully visible.

    Each causal step after the first costs half a block, the same on every rank."""
    if not causal:
        return _ALL, _ALL, False
    if step == 0:
        return _ALL, _ALL, True
    half = local_len // 2
    if source < rank:
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


@dataclass(frozen=True)
class RingSettings:
    """Everything about a ring attention call that is not a tensor."""

    group: object
    causal: bool
    softmax_scale: float | None
    backend: str = "auto"
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    head_offset: int = 0  # global index of the first local head (tensor parallelism)
    batch_offset: int = 0  # global index of the first local batch row
    zigzag: bool = False  # shard layout, for the global positions of the dropout mask
    grad_tiles: int = 0  # backward schedule of dK / dV, see ring_backward (0: overlapped hops)
    min_tile: int = 512  # smaller tiles cost more in kernel calls than their memory is worth

    def block_kwargs(self, q_len: int, k_len: int, me: int, source: int, rows, cols, device) -> dict:
        """Keyword arguments of the block kernel for rows of this rank vs cols of ``source``."""
        kwargs = dict(softmax_scale=self.softmax_scale, backend=self.backend)
        if self.dropout_p > 0.0:
            world = group_size(self.group)
            kwargs.update(
                dropout_p=self.dropout_p, dropout_seed=self.dropout_seed, head_offset=self.head_offset,
                batch_offset=self.batch_offset,
                q_positions=shard_positions(q_len, me, world, self.zigzag, device)[rows],
                k_positions=shard_positions(k_len, source, world, self.zigzag, device)[cols],
            )  # fmt: skip
        return kwargs


def _travelling(k, v, key_padding_mask) -> list[torch.Tensor]:
    return [k, v] if key_padding_mask is None else [k, v, key_padding_mask]


def ring_forward(q, k, v, key_padding_mask, settings: RingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass without autograd: q [B, H, S, D], k / v [B, H, Sk, D] local shards.

    Returns (out [B, H, S, D] in q's dtype, lse [B, H, S] fp32 (fp64 for fp64))."""
    acc = accumulation_dtype(q.dtype)
    batch, heads, seq, dim = q.shape
    out = torch.zeros(batch, heads, seq, dim, dtype=acc, device=q.device)
    lse = torch.full((batch, heads, seq), float("-inf"), dtype=acc, device=q.device)
    me = group_rank(settings.group)
    for step, source, block in ring_blocks(settings.group, _travelling(k, v, key_padding_mask)):
        k_block, v_block, *mask = block
        rows, cols, causal = block_schedule(step, me, source, k.shape[2], settings.causal)
        block_out, block_lse = attention_block_forward(
            q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols], causal=causal,
            key_padding_mask=mask[0][:, cols] if mask else None,
            **settings.block_kwargs(seq, k.shape[2], me, source, rows, cols, q.device),
        )  # fmt: skip
        merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    return out.to(q.dtype), lse


def block_tiles(rows: slice, cols: slice, q_len: int, k_len: int, causal: bool, tiles: int, min_tile: int = 1):
    """Split the block ``rows`` x ``cols`` (of the local q_len queries and k_len keys) into at most
    ``tiles`` x ``tiles`` pieces (``tiles >= 1``) of at least ``min_tile`` rows / keys (the last
    may be shorter); yields ``(row slice, col slice, causal)``.

    A causal block (step 0: all rows vs all keys, equal lengths) is cut into square tiles on the
    same grid, so a diagonal tile is causal top-left aligned, tiles below it are fully visible
    and tiles above it are skipped."""
    r0, r1, _ = rows.indices(q_len)
    c0, c1, _ = cols.indices(k_len)
    row_size = max(min_tile, -(-(r1 - r0) // tiles))
    col_size = row_size if causal else max(min_tile, -(-(c1 - c0) // tiles))
    for i, a in enumerate(range(r0, r1, row_size)):
        for j, b in enumerate(range(c0, c1, col_size)):
            if causal and j > i:
                continue
            yield slice(a, min(a + row_size, r1)), slice(b, min(b + col_size, c1)), causal and i == j


def _block_backward(dout, q, k_block, v_block, out, lse, mask, rows, cols, causal, settings, me, source):
    """The block kernel's (dq, dk, dv) for ``rows`` of this rank against ``cols`` of ``source``."""
    return attention_block_backward(
        dout[:, :, rows], q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols], out[:, :, rows], lse[:, :, rows],
        causal=causal, key_padding_mask=mask[0][:, cols] if mask else None,
        **settings.block_kwargs(q.shape[2], k_block.shape[2], me, source, rows, cols, q.device),
    )  # fmt: skip


def ring_backward(dout, q, k, v, out, lse, key_padding_mask, settings: RingSettings):
    """Backward pass without autograd, from the saved global ``out`` and ``lse``.

    Two schedules (``settings.grad_tiles``), the same gradients and bytes:

    * 0 (CUDA, :func:`_backward_overlapped`): K / V travel as in forward; the block's gradient
      comes from one kernel call, then the dK / dV pair arriving with the block's partial
      gradient is waited for, added to and sent on, so every hop overlaps a block's compute;
    * n > 0 (CPU, :func:`_backward_in_place`): before each block the K / V block and the dK / dV
      pair are swapped in place with the previous rank's (chunk by chunk), and the block's
      backward runs as n x n tiles added in place into the pair. A rank holds one foreign K / V
      block, one dK / dV pair and a tile of kernel output, instead of two K / V blocks (P > 2),
      two pairs and a block's kernel output. The hops are not overlapped: over gloo they cost
      milliseconds against seconds of block compute on CPU.

    Returns (dq, dk, dv) in the accumulation dtype (fp32, fp64 for fp64), shapes of q, k, v."""
    backward = _backward_in_place if settings.grad_tiles else _backward_overlapped
    return backward(dout, q, k, v, out, lse, key_padding_mask, settings)


def _backward_overlapped(dout, q, k, v, out, lse, key_padding_mask, settings: RingSettings):
    acc = accumulation_dtype(q.dtype)
    grad_ring = RingExchange(settings.group)
    me = group_rank(settings.group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    grads, pending = None, None  # the [dK, dV] pair of the block in hand; its hop in flight
    for step, source, block in ring_blocks(settings.group, _travelling(k, v, key_padding_mask)):
        k_block, v_block, *mask = block
        rows, cols, causal = block_schedule(step, me, source, k.shape[2], settings.causal)
        dq_block, dk_block, dv_block = _block_backward(dout, q, k_block, v_block, out, lse, mask, rows, cols, causal,
                                                       settings, me, source)
        dq[:, :, rows] += dq_block
        if step == 0:  # own block: its dK / dV start their trip here
            grads = [dk_block.to(acc), dv_block.to(acc)]
        else:  # the block's gradient so far arrives with it, one step behind the K / V
            grads = pending.wait()
            grads[0][:, :, cols] += dk_block
            grads[1][:, :, cols] += dv_block
        del dq_block, dk_block, dv_block  # free before the next block's kernel call
        pending = grad_ring.start(grads)
    dk, dv = pending.wait()  # the P-th hop brings our own block's gradient home
    return dq, dk, dv


def _backward_in_place(dout, q, k, v, out, lse, key_padding_mask, settings: RingSettings):
    acc = accumulation_dtype(q.dtype)
    ring = RingExchange(settings.group)
    me = group_rank(settings.group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    block = _travelling(k, v, key_padding_mask)  # step 0: our own K / V (and mask)
    grads = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
    for step in range(ring.size):
        if step == 1:  # the saved K / V stay ours: a copy travels, overwritten by each hop
            block = [t.clone(memory_format=torch.contiguous_format) for t in block]
        if step > 0:  # the previous rank's K / V block and its dK / dV so far, into the same buffers
            ring.swap(block + grads)
        source = (me - step) % ring.size
        k_block, v_block, *mask = block
        rows, cols, causal = block_schedule(step, me, source, k.shape[2], settings.causal)
        for tile_rows, tile_cols, tile_causal in block_tiles(rows, cols, q.shape[2], k.shape[2], causal,
                                                             settings.grad_tiles, settings.min_tile):
            dq_tile, dk_tile, dv_tile = _block_backward(dout, q, k_block, v_block, out, lse, mask, tile_rows,
                                                        tile_cols, tile_causal, settings, me, source)
            dq[:, :, tile_rows] += dq_tile
            grads[0][:, :, tile_cols] += dk_tile
            grads[1][:, :, tile_cols] += dv_tile
            del dq_tile, dk_tile, dv_tile  # free before the next tile's kernel call
    del block, k_block, v_block, mask  # the last K / V block is not needed for the final hop
    ring.swap(grads)  # the P-th hop brings our own block's gradient home
    return dq, grads[0], grads[1]


class RingAttentionFunction(torch.autograd.Function):
    """Differentiable ring attention in q, k, v (the mask and settings get no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, settings):
        out, lse = ring_forward(q, k, v, key_padding_mask, settings)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
        ctx.settings = settings
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, key_padding_mask, ctx.settings)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _check_ring_inputs(q, k, v, key_padding_mask, group, causal, zigzag) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"ring_attention: {name} must be a [batch, heads, seq/P, head_dim] tensor, got {shape}")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must agree on batch, "
            "heads and head_dim, and k, v must have one shape; repeat k / v heads for grouped-query attention"
        )
    world = group_size(group)
    if causal and zigzag is False and world > 1:
        raise ValueError(
            "ring_attention: causal attention over P > 1 ranks needs zigzag shards, got zigzag=False; shard with "
            "shard_sequence(x, group, dim=2, zigzag=True), or use ulysses_attention(..., zigzag=False)"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"ring_attention: causal attention needs equal local query and key lengths, got {q.shape[2]} and "
            f"{k.shape[2]}; shard q, k and v with the same shard_sequence(..., zigzag=True) call pattern"
        )
    if causal and world > 1 and q.shape[2] % 2 != 0:
        raise ValueError(
            f"ring_attention: causal attention uses zigzag shards of two equal chunks, but the local sequence "
            f"length {q.shape[2]} is odd; pad the full sequence to a multiple of 2*P = {2 * world} and shard it "
            "with shard_sequence(x, group, dim=2, zigzag=True)"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2])
    ):
        raise ValueError(
            f"ring_attention: key_padding_mask must be this rank's bool [batch, seq/P] = {(k.shape[0], k.shape[2])} "
            f"slice (True = attend), got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}; shard it with "
            "shard_padding_mask(mask, group, zigzag=causal)"
        )


def ring_attention(q, k, v, *, group, causal=False, key_padding_mask=None, softmax_scale=None, dropout_p=0.0,
                   dropout_seed=None, head_offset=0, batch_offset=0, zigzag=None):
    """Exact attention over a sequence sharded across ``group`` (ring attention).

    Args:
        q: [batch, heads, seq/P, head_dim] this rank's query shard; k, v: [batch, heads,
            seq/P, head_dim] this rank's key / value shards (same sharding as their mask).
        group: the sequence-parallel process group (e.g. ``mesh.sp_group``), P ranks.
        causal: causal attention over the *global* positions; inputs must then be zigzag
            shards (``shard_sequence(x, group, dim=2, zigzag=True)``).
        key_padding_mask: this rank's bool [batch, seq/P] slice, True = attend.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        dropout_p: dropout on the attention probabilities, in [0, 1) (inside the block kernel;
            the caller decides training vs eval).
        dropout_seed: int seed of the stateless mask, the same on every rank of ``group``;
            None draws one from torch's default generator (equal on ranks seeded alike).
        head_offset, batch_offset: global index of the local first head / batch row (for the
            mask, when heads or batch are split over other mesh axes).
        zigzag: shard layout, for the mask's global positions; None means zigzag exactly when
            ``causal`` (the convention; causal over P > 1 ranks requires zigzag).

    Returns:
        [batch, heads, seq/P, head_dim] in q's dtype: this rank's rows of the attention output.
        Rows that see no key are 0. Activation memory per rank is O(seq/P); K, V (and the
        mask) take P-1 hops in forward, dK / dV P hops in backward. With dropout the result
        equals single-rank ``flash_attention`` with the same seed on the gathered sequence.
    """
    _check_ring_inputs(q, k, v, key_padding_mask, group, causal, zigzag)
    if dropout_p and dropout_seed is None:
        dropout_seed = draw_dropout_seed()
    settings = RingSettings(group, bool(causal), softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                            head_offset=head_offset, batch_offset=batch_offset,
                            zigzag=bool(causal) if zigzag is None else bool(zigzag),
                            grad_tiles=CPU_GRAD_TILES if q.device.type == "cpu" else 0)
    return RingAttentionFunction.apply(q, k, v, key_padding_mask, settings)
