"""A sliding window in ring attention: which pieces of a block are computed, and how.

transformers' ``sliding_window`` (Mistral, Qwen2's ``use_sliding_window``): the query at global
position p sees the keys at positions j with p - window < j <= p. A rank's tokens are runs of
consecutive global positions (zigzag: chunks r and 2P-1-r of every document). Each visible
rect of the plan (``DocumentSplit.rects``) is cut at the run boundaries, so rows and columns of
every piece map onto global positions by an offset, and a piece is:

* skipped when its latest key is at or before its earliest query minus the window: no kernel
  call in forward or backward (the K / V still pass round the ring);
* computed unmasked when its earliest key is after its latest query minus the window (inside
  every row's window), on the device's own kernel (Triton on CUDA);
* computed with the window mask otherwise (the kernel's ``window`` from the global positions;
  on CUDA the torch reference, as the Triton kernel has no window).
"""

from __future__ import annotations

from typing import Iterator

from shardzoo.layers.packing import DocumentSplit, Rect, tile_rect

Run = tuple[int, int, int]  # (l0, l1, g0): local tokens [l0, l1) at global positions [g0, g0 + l1 - l0)


def runs(split: DocumentSplit, rank: int) -> list[Run]:
    """``(l0, l1, g0)`` for each run of consecutive global positions of ``rank``'s tokens, in
    local order: local index x of the run is at global position g0 + x - l0."""
    out = []
    for w in split.windows[rank]:
        if w.first:
            out.append((w.offset, w.offset + w.first, w.first_at))
        if w.second:
            out.append((w.offset + w.first, w.offset + w.size, w.second_at))
    return out


def _global(runs_: list[Run], x: int) -> int:
    for l0, l1, g0 in runs_:
        if l0 <= x < l1:
            return g0 + x - l0
    raise IndexError(f"local index {x} is in none of the runs {runs_}")


def cut(rect: Rect, row_runs: list[Run], col_runs: list[Run]) -> list[Rect]:
    """``rect`` cut at the run boundaries of both sides. A causal rect (source = this rank: a
    square over the same runs) keeps its diagonal squares causal, takes the earlier runs' keys
    whole and drops the pieces whose keys all come after their queries."""
    r0, r1, c0, c1, diag = rect
    out: list[Rect] = []
    for i, (a0, a1, _) in enumerate(row_runs):
        a0, a1 = max(a0, r0), min(a1, r1)
        for j, (b0, b1, _) in enumerate(col_runs):
            b0, b1 = max(b0, c0), min(b1, c1)
            if a0 >= a1 or b0 >= b1 or (diag and j > i):
                continue
            out.append((a0, a1, b0, b1, diag and i == j))
    return out


def window_pieces(split: DocumentSplit, me: int, source: int, causal: bool, window: int | None,
                  row_tile: int | None, cols: tuple[int, int] | None) -> Iterator[tuple[Rect, bool]]:
    """``(piece, banded)`` for every kernel call of ``me``'s queries against ``source``'s keys
    (restricted to ``cols``, in row tiles of ``row_tile``): ``banded`` when the window mask must
    be applied. Without a window, the plan's pieces, none banded."""
    rects = split.rects(me, source, causal)
    if window is None:
        for rect in rects:
            for piece in tile_rect(rect, row_tile, cols):
                yield piece, False
        return
    q_runs, k_runs = runs(split, me), runs(split, source)
    for rect in rects:
        for sub in cut(rect, q_runs, k_runs):
            for piece in tile_rect(sub, row_tile, cols):
                r0, r1, c0, c1, _ = piece
                if _global(k_runs, c1 - 1) <= _global(q_runs, r0) - window:
                    continue  # every key before every query's window
                yield piece, _global(k_runs, c0) <= _global(q_runs, r1 - 1) - window
