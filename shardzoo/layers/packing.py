"""Packed documents over a sequence-parallel group: the balanced split and the blocks it needs.

A packed sequence concatenates documents of arbitrary lengths; attention is causal (or full)
within each document and never crosses a boundary. Boundaries come as ``cu_seqlens`` (int32
offsets ``[0, l0, l0+l1, ..., S]``, flash-attn's varlen convention) or as transformers' packed
``position_ids`` (restarting at 0 per document), which :func:`cu_seqlens_from_position_ids`
converts.

The split (:class:`DocumentSplit`) zigzags *each document* over the P ranks: the document is
cut into 2P pieces and rank r holds pieces r and 2P-1-r, so it owns as many early (cheap) as
late (expensive) query rows of every document. A length that is not a multiple of 2P leaves
``L mod 2P`` tokens over; they go one per rank, round-robin with a cursor that carries over
from document to document, so token counts per rank differ by at most one over the whole
sequence (none when P divides S). A rank's local stream is its window of every document in
document order, each window its first piece then its second (local order = document order).

The same plan describes dense sequences: one document of length S, equal pieces (zigzag
for causal attention, contiguous otherwise), so ring attention has one code path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Window:
    """One document's tokens on one rank: ``first`` tokens from global position ``first_at``,
    then ``second`` tokens from ``second_at``; they start at local index ``offset``."""

    doc: int
    offset: int
    first: int
    first_at: int
    second: int
    second_at: int

    @property
    def size(self) -> int:
        return self.first + self.second


# A block of the attention matrix one kernel call computes: local query rows [r0, r1) against
# local key columns [c0, c1) of a source rank; causal means square and top-left aligned.
Rect = tuple[int, int, int, int, bool]


@dataclass(frozen=True)
class DocumentSplit:
    """Which tokens of a packed sequence each rank holds, and the blocks ring attention needs.

    ``windows[r]`` lists rank r's :class:`Window` per document (empty ones left out),
    ``lengths`` the document lengths. Build with :func:`split_documents` (cached) or
    :func:`dense_split`."""

    world: int
    lengths: tuple[int, ...]
    windows: tuple[tuple[Window, ...], ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def local_len(self, rank: int) -> int:
        return sum(w.size for w in self.windows[rank])

    @property
    def max_len(self) -> int:
        """The longest local shard: the size every block has on its way round the ring."""
        return max(self.local_len(r) for r in range(self.world))

    @functools.cached_property
    def _positions(self) -> tuple[torch.Tensor, ...]:
        out = []
        for wins in self.windows:
            pieces = []
            for w in wins:  # first piece then second, document by document
                pieces.append(torch.arange(w.first_at, w.first_at + w.first))
                pieces.append(torch.arange(w.second_at, w.second_at + w.second))
            out.append(torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64))
        return tuple(out)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions, int64 [local_len(rank)], of rank ``rank``'s tokens in local order."""
        return self._positions[rank].to(device) if device is not None else self._positions[rank]

    @functools.cached_property
    def gather_index(self) -> torch.Tensor:
        """int64 [S]: where each global position sits in the rank-major stream of shards, each
        padded to ``max_len`` (rank r's local token i at ``r * max_len + i``)."""
        index = torch.empty(self.total, dtype=torch.int64)
        for r in range(self.world):
            pos = self.positions(r)
            index[pos] = torch.arange(len(pos)) + r * self.max_len
        return index

    def rects(self, me: int, source: int, causal: bool) -> list[Rect]:
        """The blocks of this rank's queries against ``source``'s keys that the mask leaves
        visible, one or none per document; everything else is skipped, not masked.

        Causal, per document (pieces r, 2P-1-r here, s, 2P-1-s at the source): own window vs
        own window, causal; ``source < me``: all rows vs the source's first piece, which lies
        before both of ours; ``source > me``: our second piece vs the whole source window,
        which lies between our pieces."""
        theirs = {w.doc: w for w in self.windows[source]}
        out: list[Rect] = []
        for w in self.windows[me]:
            s = theirs.get(w.doc)
            if s is None:
                continue
            rows, cols, diag = (w.offset, w.offset + w.size), (s.offset, s.offset + s.size), False
            if causal and source == me:
                diag = True
            elif causal and source < me:
                cols = (s.offset, s.offset + s.first)
            elif causal:
                rows = (w.offset + w.first, w.offset + w.size)
            if rows[1] > rows[0] and cols[1] > cols[0]:
                out.append((rows[0], rows[1], cols[0], cols[1], diag))
        return out

    def work(self, causal: bool) -> list[int]:
        """Visible (query, key) pairs per rank: the attention FLOPs up to a constant."""
        totals = []
        for r in range(self.world):
            total = 0
            for w in self.windows[r]:
                if not causal:
                    total += w.size * self.lengths[w.doc]
                    continue
                start = sum(self.lengths[: w.doc])
                for at, n in ((w.first_at - start, w.first), (w.second_at - start, w.second)):
                    total += n * at + n * (n + 1) // 2  # row at document position p sees p + 1 keys
            totals.append(total)
        return totals


def _split(lengths: tuple[int, ...], world: int) -> DocumentSplit:
    windows: list[list[Window]] = [[] for _ in range(world)]
    offsets = [0] * world
    cursor, start = 0, 0
    for doc, length in enumerate(lengths):
        base, rem = divmod(length, 2 * world)
        share = [2 * base] * world
        for j in range(rem):  # leftover tokens round-robin, carried over documents
            share[(cursor + j) % world] += 1
        cursor = (cursor + rem) % world
        firsts = [n - n // 2 for n in share]
        pieces = firsts + [share[r] // 2 for r in reversed(range(world))]  # pieces 0 .. 2P-1
        starts = [start + sum(pieces[:i]) for i in range(2 * world)]
        for r in range(world):
            if share[r]:
                windows[r].append(Window(doc, offsets[r], firsts[r], starts[r], share[r] // 2,
                                         starts[2 * world - 1 - r]))
                offsets[r] += share[r]
        start += length
    return DocumentSplit(world, lengths, tuple(tuple(w) for w in windows))


@functools.lru_cache(maxsize=64)
def split_documents(lengths: tuple[int, ...], world: int) -> DocumentSplit:
    """The balanced split of documents of ``lengths`` over ``world`` ranks (cached)."""
    return _split(tuple(int(n) for n in lengths), world)


@functools.lru_cache(maxsize=64)
def dense_split(local_len: int, world: int, zigzag: bool) -> DocumentSplit:
    """One dense sequence of ``world * local_len`` tokens, contiguous or zigzag shards."""
    windows = []
    for r in range(world):
        if zigzag and world > 1:
            half = local_len // 2
            windows.append((Window(0, 0, half, r * half, half, (2 * world - 1 - r) * half),))
        else:
            windows.append((Window(0, 0, local_len, r * local_len, 0, (r + 1) * local_len),))
    return DocumentSplit(world, (world * local_len,), tuple(windows))


def check_cu_seqlens(cu_seqlens, who: str) -> tuple[int, ...]:
    """Validate int32 offsets [docs + 1] and return the document lengths."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) else \
            type(cu_seqlens).__name__
        raise ValueError(f"{who}: cu_seqlens must be an int32 tensor [docs + 1] of offsets into the packed sequence "
                         f"(flash-attn varlen style, e.g. [0, 5, 12]), got {got}; build it with "
                         "torch.tensor(offsets, dtype=torch.int32) or cu_seqlens_from_position_ids(position_ids)")
    offsets = cu_seqlens.tolist()
    if len(offsets) < 2 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{who}: cu_seqlens={offsets} must start at 0 and increase strictly (every document at "
                         "least one token); drop empty documents")
    return tuple(b - a for a, b in zip(offsets, offsets[1:]))


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' packed format -> cu_seqlens: ``position_ids`` [1, S] (or [S]) restart at 0
    at every document start (``DataCollatorWithFlattening``). Returns int32 [docs + 1]."""
    pos = position_ids.reshape(-1) if position_ids.dim() == 2 and position_ids.shape[0] == 1 else position_ids
    if pos.dim() != 1 or pos.numel() == 0 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_from_position_ids: position_ids must be an integer [1, S] tensor of the whole "
                         f"packed batch (batch 1), got {pos.dtype} {tuple(position_ids.shape)}")
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or starts[0] != 0:
        raise ValueError("cu_seqlens_from_position_ids: position_ids must start at 0 (each document counts from 0); "
                         f"got {pos[:8].tolist()}...")
    total = torch.tensor([pos.numel()], device=starts.device)
    return torch.cat([starts, total]).to(torch.int32)


def tile_rect(rect: Rect, row_tile: int | None, cols: tuple[int, int] | None = None):
    """Cut one visible block into kernel calls: rows in pieces of at most ``row_tile`` (None:
    whole), keys restricted to ``cols`` = [c_lo, c_hi) when given. Yields :data:`Rect` tuples.

    A causal (square, top-left aligned) block splits into squares on its diagonal, still causal,
    and fully visible rectangles to their left; parts above the diagonal are never visited."""
    r0, r1, c0, c1, causal = rect
    lo, hi = (c0, c1) if cols is None else (max(c0, cols[0]), min(c1, cols[1]))
    if lo >= hi:
        return
    step = row_tile or (r1 - r0)
    if not causal:
        for a in range(r0, r1, step):
            yield a, min(a + step, r1), lo, hi, False
        return
    j0, j1 = lo - c0, hi - c0  # key offsets inside the square; row r0 + i sees keys c0 .. c0 + i
    for i0 in range(j0, j1, step):
        i1 = min(i0 + step, j1)
        if i0 > j0:
            yield r0 + i0, r0 + i1, lo, c0 + i0, False
        yield r0 + i0, r0 + i1, c0 + i0, c0 + i1, True
    for a in range(r0 + j1, r1, step):  # rows below the keys' diagonal see all of them
        yield a, min(a + step, r1), lo, hi, False
