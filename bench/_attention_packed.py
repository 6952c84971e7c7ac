"""Packed documents and grouped-query attention for bench/attention.py.

Packed: ``total`` tokens of documents whose lengths are log-normal (median 512 tokens, log-space
standard deviation 1.5, at least 1 token, the last document cut to fit;
``shardzoo.testing.packed_attention.long_tailed_lengths``), causal within each document, batch 1,
fp32. On one rank the baseline runs ``F.scaled_dot_product_attention(is_causal=True)`` document
by document (the documents' q / k / v are split views, outputs concatenated); on P ranks
``ring_attention`` / ``ulysses_attention`` with ``cu_seqlens`` over the balanced per-document
split. Work per rank = visible (query, key) pairs of the rank's rows, from the split; the same
for the alternative of zigzagging the packed stream as one sequence (2P equal chunks, rank r
holding r and 2P-1-r) is shown for comparison.

GQA bytes: ``comm.count()`` around one fwd + bwd with kv_heads = heads / 4 against the same
call with the kv heads repeated to ``heads`` (what a ring without grouped-query support sends).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

from _results import timed_attention_step
from shardzoo import comm
from shardzoo.layers.packing import split_documents
from shardzoo.layers.ring_attention import ring_attention
from shardzoo.layers.ulysses import ulysses_attention
from shardzoo.testing.packed_attention import long_tailed_lengths, offsets

MIB = 2**20
PACKED_LABELS = {"sdpa_docs": "SDPA per document (1 rank)", "ring_packed": "shardzoo ring_attention, cu_seqlens",
                 "ulysses_packed": "shardzoo ulysses_attention, cu_seqlens"}


def _per_document_sdpa(q, k, v, dout, lengths, group):
    pieces = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
    out = torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in pieces], 2)
    out.backward(dout)


def _packed_step(attention):
    def step(q, k, v, dout, lengths, group):
        attention(q, k, v, group=group, causal=True, cu_seqlens=offsets(lengths)).backward(dout)
    return step


PACKED_STEPS = {"sdpa_docs": _per_document_sdpa, "ring_packed": _packed_step(ring_attention),
                "ulysses_packed": _packed_step(ulysses_attention)}


def measure_packed(method: str, lengths: list[int], heads: int, head_dim: int) -> tuple[float, float, int]:
    """On every rank: (seconds, peak MiB, local tokens) of one causal fwd + bwd over this rank's
    shard of the packed documents."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = split_documents(tuple(lengths), world).local_len(rank)
    seconds, peak = timed_attention_step(
        lambda q, k, v, dout: PACKED_STEPS[method](q, k, v, dout, lengths, dist.group.WORLD), local, heads, head_dim)
    return seconds, peak, local


def stream_zigzag_work(lengths: list[int], world: int) -> list[int]:
    """Visible causal pairs per rank if the packed stream were zigzagged as one sequence."""
    total = sum(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seen = torch.arange(total) - starts[doc] + 1  # a row sees its document's earlier tokens and itself
    chunks = seen.tensor_split(2 * world)
    return [int(chunks[r].sum() + chunks[2 * world - 1 - r].sum()) for r in range(world)]


def count_gqa_bytes(mode: str, heads: int, kv_heads: int, seq: int, head_dim: int) -> float:
    """Bytes this rank sends in one causal fwd + bwd, kv_heads kv heads."""
    world = dist.get_world_size()
    group = dist.group.WORLD
    q = torch.randn(1, heads, seq // world, head_dim, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, seq // world, head_dim, requires_grad=True) for _ in range(2))
    attention = ring_attention if mode == "ring" else ulysses_attention
    with comm.count() as counter:
        attention(q, k, v, group=group, causal=True).sum().backward()
    return float(counter.total_bytes)


def run_packed(args, pool_for) -> list[dict]:
    """The packed rows: per world, each method on the same documents; times are medians over
    ``args.reps`` interleaved reps (slowest rank), peaks the smallest rep's largest rank."""
    import statistics

    lengths = long_tailed_lengths(args.packed_tokens, args.packed_seed)
    rows = []
    for world in [1] + [w for w in args.worlds if w > 1]:
        methods = ["sdpa_docs"] if world == 1 else ["ring_packed", "ulysses_packed"]
        pool = pool_for(world)
        pool.run(measure_packed, methods[0], long_tailed_lengths(512 * world, 1), args.heads, args.head_dim)  # warm-up
        runs = {m: [] for m in methods}
        for rep in range(args.reps):
            for method in methods if rep % 2 == 0 else methods[::-1]:
                runs[method].append(pool.run(measure_packed, method, lengths, args.heads, args.head_dim))
        split = split_documents(tuple(lengths), world)
        work, zigzag = split.work(True), stream_zigzag_work(lengths, world)
        for method in methods:
            floor = 8 * args.heads * split.max_len * args.head_dim * 4 / MIB
            peak = min(max(r[1] for r in ranks) for ranks in runs[method])
            rows.append(dict(method=method, world=world, tokens=sum(lengths), docs=len(lengths),
                             seconds=statistics.median(max(r[0] for r in ranks) for ranks in runs[method]),
                             peak_mib=peak, floor_mib=floor, work_max_over_mean=max(work) * world / sum(work),
                             stream_zigzag_max_over_mean=max(zigzag) * world / sum(zigzag)))
            print(f"{PACKED_LABELS[method]:45s} ranks={world} {rows[-1]['seconds']:8.3f} s  peak {peak:7.1f} MiB "
                  f"(floor {floor:.1f})  work max/mean {rows[-1]['work_max_over_mean']:.3f}", flush=True)
    return rows


def run_gqa_bytes(args, pool_for) -> list[dict]:
    """Bytes per rank, 4:1 grouped-query attention vs the kv heads repeated, ring and Ulysses."""
    rows = []
    heads = max(args.heads, 4)
    for world in [w for w in args.worlds if w > 1]:
        pool = pool_for(world)
        for mode in ("ring", "ulysses"):
            gqa = pool.run(count_gqa_bytes, mode, heads, heads // 4, args.gqa_seq, args.head_dim)[0]
            repeated = pool.run(count_gqa_bytes, mode, heads, heads, args.gqa_seq, args.head_dim)[0]
            rows.append(dict(mode=mode, world=world, heads=heads, kv_heads=heads // 4, seq=args.gqa_seq,
                             gqa_bytes=gqa, repeated_bytes=repeated, ratio=gqa / repeated))
            print(f"GQA {mode:8s} ranks={world} {gqa / MIB:8.2f} MiB vs repeated {repeated / MIB:8.2f} MiB "
                  f"= {gqa / repeated:.3f}", flush=True)
    return rows
