"""The ring attention core: settings, the ring iterator, the block merge and the forward pass.

Ring attention (the public function is in ring_attention.py, backward in ring_backward.py) is
three pieces (DESIGN principle 6):

* a block kernel, :func:`shardzoo.kernels.attention_block_forward` / ``_backward``, returning
  ``(out, lse)`` for one query block against one key block, without a score matrix;
* a ring iterator that hands each rank every K/V block of the group in turn: on CUDA
  :func:`ring_blocks`, whole blocks with the next one already on its way (async p2p
  overlapping the compute); on CPU :func:`chunks_round_ring`, one key chunk at a time swapped
  in place, so a rank holds a chunk of foreign K/V instead of two blocks;
* a merge, :func:`merge_block`, folding each block's ``(out, lse)`` into the running result in
  fp32 by log-sum-exp.

Which parts of a block are computed comes from a :class:`~shardzoo.layers.packing.DocumentSplit`
(``rects``): for a dense causal sequence the zigzag schedule (rank r holds chunks r and
2P-1-r; every step after the first costs half a block), for packed documents (``cu_seqlens``)
the same schedule per document, and nothing across documents. Blocks outside the mask are
skipped, not masked; with a sliding window (``RingSettings.window``) the blocks are cut at the
zigzag chunks and those wholly outside every query's window are skipped too (ring_window.py).
Grouped-query attention (k, v with H_kv < H heads) circulates the H_kv heads and repeats them
for the kernel call only.

Dropout on the probabilities runs inside the block kernel with a stateless mask of the global
(batch, head, query position, key position): each block gets the global positions of its query
rows and key columns, so the ring draws exactly the mask of single-rank attention with the same
seed. See docs/sequence_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from shardzoo.comm import RingExchange
from shardzoo.comm.ops import group_rank, group_size
from shardzoo.kernels import attention_block_forward
from shardzoo.layers.packing import DocumentSplit, dense_split
from shardzoo.layers.ring_window import window_pieces
from shardzoo.layers.sequence import shard_positions

CPU_GRAD_TILES = 16  # on CPU a block runs as (up to) 16 row tiles x 16 key chunks (ring_backward.py)


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
    zigzag: bool = False  # dense shard layout, for the global positions of the dropout mask
    grad_tiles: int = 0  # 0: CUDA schedule (whole blocks, overlapped hops); n: n key chunks x n row tiles (CPU)
    min_tile: int = 256  # smaller tiles cost more in kernel calls than their memory is worth
    split: DocumentSplit | None = None  # packed documents; None: one dense sequence
    return_lse: bool = False
    window: int | None = None  # sliding window (causal): query at p sees keys in (p - window, p]

    def plan(self, local_len: int) -> DocumentSplit:
        """The split the shards follow: the packed one, or the dense one of ``local_len``."""
        return self.split or dense_split(local_len, group_size(self.group), self.causal)

    def tile(self, length: int) -> int | None:
        """Rows / keys per kernel call on a side of ``length`` (None: whole blocks)."""
        return max(self.min_tile, -(-length // self.grad_tiles)) if self.grad_tiles else None

    def positions(self, rank: int, length: int, device) -> torch.Tensor:
        if self.split is not None:
            return self.split.positions(rank, device)
        return shard_positions(length, rank, group_size(self.group), self.zigzag, device)

    def pieces(self, me: int, source: int, q_len: int, row_tile: int | None, cols=None):
        """``(piece, banded)`` for the kernel calls of this rank's queries against ``source``'s
        keys (ring_window.py): the plan's visible rects, cut by the window when there is one."""
        return window_pieces(self.plan(q_len), me, source, self.causal, self.window, row_tile, cols)

    def block_kwargs(self, q_len: int, me: int, source: int, piece, device, banded: bool = False) -> dict:
        """Keyword arguments of the block kernel for the ``piece`` (rows of this rank, cols of
        ``source``); ``banded``: the piece needs the window mask."""
        kwargs = dict(softmax_scale=self.softmax_scale, backend=self.backend)
        r0, r1, c0, c1, _ = piece
        if banded or self.dropout_p > 0.0:
            kwargs.update(q_positions=self.positions(me, q_len, device)[r0:r1],
                          k_positions=self.positions(source, q_len, device)[c0:c1])
        if banded:
            kwargs.update(window=self.window)
        if self.dropout_p > 0.0:
            kwargs.update(
                dropout_p=self.dropout_p, dropout_seed=self.dropout_seed, head_offset=self.head_offset,
                batch_offset=self.batch_offset,
            )  # fmt: skip
        return kwargs


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, s, d] -> [B, H_kv * groups, s, d]: query head h reads kv head h // groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def fold_kv_grad(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of :func:`expand_kv`: sum the gradients of each kv head's query group."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def pad_to(tensors: list[torch.Tensor], length: int, dim: int) -> list[torch.Tensor]:
    """Zero-pad each tensor along ``dim`` to ``length`` (blocks travel at the longest shard's size)."""
    out = []
    for t in tensors:
        extra = length - t.shape[dim]
        if extra:
            shape = list(t.shape)
            shape[dim] = extra
            t = torch.cat([t, t.new_zeros(shape)], dim)
        out.append(t)
    return out


def ring_forward(q, k, v, key_padding_mask, settings: RingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass without autograd: q [B, H, S, D], k / v [B, H_kv, S, D] local shards.

    Two schedules, as backward's (ring_backward.py): with ``settings.grad_tiles == 0`` (CUDA)
    whole K / V blocks travel while the previous one is computed (two blocks in flight); with
    n > 0 (CPU) the keys go round the ring in n chunks, swapped in place, one chunk in hand.

    Returns (out [B, H, S, D] in q's dtype, lse [B, H, S] fp32 (fp64 for fp64))."""
    acc = accumulation_dtype(q.dtype)
    batch, heads, seq, dim = q.shape
    out = torch.zeros(batch, heads, seq, dim, dtype=acc, device=q.device)
    lse = torch.full((batch, heads, seq), float("-inf"), dtype=acc, device=q.device)
    me, plan = group_rank(settings.group), settings.plan(seq)
    row_tile = settings.tile(seq)

    def attend(block, source, cols):
        """Merge the visible part of ``block`` (keys ``cols`` of ``source``) into out / lse."""
        k_block, v_block, *mask = block
        groups = heads // k_block.shape[1]
        for piece, banded in settings.pieces(me, source, seq, row_tile, cols):
            r0, r1, c0, c1, causal = piece
            a, b = c0 - cols[0], c1 - cols[0]
            block_out, block_lse = attention_block_forward(
                q[:, :, r0:r1], expand_kv(k_block[:, :, a:b], groups), expand_kv(v_block[:, :, a:b], groups),
                causal=causal, key_padding_mask=mask[0][:, a:b] if mask else None,
                **settings.block_kwargs(seq, me, source, piece, q.device, banded),
            )  # fmt: skip
            merge_block(out[:, :, r0:r1], lse[:, :, r0:r1], block_out, block_lse)
            del block_out, block_lse

    if settings.grad_tiles:
        for c0, c1, source, block, _ in chunks_round_ring(settings.group, k, v, key_padding_mask, plan.max_len,
                                                          settings.tile(plan.max_len)):
            attend(block, source, (c0, c1))
            del block
    else:
        travelling = pad_to([k, v], plan.max_len, 2)
        if key_padding_mask is not None:
            travelling += pad_to([key_padding_mask], plan.max_len, 1)
        for _, source, block in ring_blocks(settings.group, travelling):
            attend(block, source, (0, plan.max_len))
            # drop the block before the ring resumes: it sends the next block while receiving
            # the one after, and a third block held here would be one too many in flight
            del block
    return out.to(q.dtype), lse


def chunks_round_ring(group, k, v, key_padding_mask, width: int, chunk: int, riders=None):
    """Yield ``(c0, c1, source, [k, v(, mask)], riding)``: key chunk [c0, c1) of every rank's
    shard in turn, all P sources of a chunk before the next chunk.

    Step 0 hands out views of our own chunk; later steps swap a copy in place with the previous
    rank's (blocking; one chunk of K / V in hand, zero-padded to ``c1 - c0`` keys where our shard
    is shorter than ``width``). ``riders``: optional ``(c0, c1) -> list of tensors`` that travel
    with the chunk (dK / dV in backward); after a chunk's P steps they take one more hop, which
    brings our own chunk's home, announced by a last ``(c0, c1, None, None, riding)``."""
    ring = RingExchange(group)
    me, own = group_rank(group), k.shape[2]
    for c0 in range(0, width, chunk):
        c1 = min(width, c0 + chunk)
        mine = slice(c0, min(c1, own))
        block = [k[:, :, mine], v[:, :, mine]] + ([] if key_padding_mask is None else [key_padding_mask[:, mine]])
        riding = riders(c0, c1) if riders is not None else []
        for step in range(ring.size):
            if step == 1:  # our K / V stay ours: a copy of the chunk travels, overwritten by each hop
                block = [t.clone(memory_format=torch.contiguous_format) for t in block]
                block = pad_to(block[:2], c1 - c0, 2) + pad_to(block[2:], c1 - c0, 1)
            if step > 0:  # the previous rank's chunk (and what rides with it), into the same buffers
                ring.swap(block + riding)
            yield c0, c1, (me - step) % ring.size, block, riding
        del block  # the last K / V chunk is not needed for the riders' final hop
        if riders is not None:
            ring.swap(riding)
            yield c0, c1, None, None, riding
