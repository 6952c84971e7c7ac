"""Ring attention memory and time vs full attention and torch's ring core, on CPU.

Causal self-attention, fwd + bwd, batch 1, fp32, zigzag shards. Peers, in the same launch:

* SDPA on 1 rank: ``F.scaled_dot_product_attention(is_causal=True)`` over the full sequence
  (torch's fused CPU flash kernel, itself O(seq) memory), with every core of the machine;
* torch's ring core: ``_templated_ring_attention`` / ``_backward`` from
  ``torch.distributed.tensor.experimental._context_parallel`` with the CPU flash op and the
  ring (all-to-all) rotater. ``context_parallel()`` itself does not run on CPU: its SDPA
  handlers cover only the CUDA flash / efficient / cuDNN ops, so the core is called directly;
* shardzoo's ring with the CUDA schedule of dK / dV (``grad_tiles=0``: hops overlapped, one
  kernel call per block) on the same CPU ranks (skip with ``--no-overlapped``), to show what the
  CPU schedule (tiles added into the arriving dK / dV) saves and costs;
* shardzoo ``ring_attention`` on 1 rank (skip with ``--no-ring-on-one-rank``): its block kernel
  alone (on CPU torch's fused CPU flash op, the ``aten`` backend), the base against which the
  longest sequence per rank should grow linearly with the number of ranks.

Memory: peak resident set of each rank process during one fwd + bwd (Linux VmHWM, reset through
/proc/self/clear_refs just before the step) minus the RSS before the inputs were allocated,
with glibc's mmap threshold pinned so freed tensors go back to the OS; max over ranks. It
includes inputs, outputs, gradients, saved activations, kernel temporaries and comm buffers.
Time: median over reps of fwd + bwd between two barriers (so the slowest rank counts); the
reps interleave the methods of one rank count (alternating order), so their time ratios are paired.

    python bench/attention.py                                  # 4k .. 32k on 1 (SDPA), 2 and 4 ranks
    python bench/attention.py --seqs 4096 8192 --reps 1        # what a 2-core machine manages
    python bench/attention.py --seqs 2048 --worlds 1 2 --reps 1  # smoke test
    python bench/attention.py --no-dense --packed --gqa-bytes   # packed documents and GQA bytes only

Packed documents and grouped-query attention (``--packed``, ``--gqa-bytes``; bench/_attention_packed.py):
32k tokens of long-tailed document lengths, ring / Ulysses with ``cu_seqlens`` against SDPA run
document by document on one rank, with work balance and peak memory against the floor; and
the bytes each rank sends with 4:1 grouped-query attention against the kv heads repeated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # before any worker spawns

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import markdown_table, timed_attention_step, write_results  # noqa: E402
from shardzoo.comm.workers import WorkerPool  # noqa: E402
from shardzoo.layers.ring_attention import ring_attention  # noqa: E402

MIB = 2**20


def _sdpa_step(q, k, v, dout, group):
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)


def _ring_step(q, k, v, dout, group):
    ring_attention(q, k, v, group=group, causal=True).backward(dout)


def _ring_overlapped_step(q, k, v, dout, group):
    from shardzoo.layers.ring_attention import RingAttentionFunction, RingSettings

    settings = RingSettings(group, True, None, zigzag=True, grad_tiles=0)  # the CUDA schedule
    RingAttentionFunction.apply(q, k, v, None, settings).backward(dout)


def _torch_ring_step(q, k, v, dout, group):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    cp._cp_options.rotate_method = cp._RotateMethod.ALL_TO_ALL  # the ring; ALL_GATHER holds all K/V
    cp._cp_options.enable_load_balance = True  # zigzag, as our shards
    aten = torch.ops.aten
    with torch.no_grad():
        out, lse = cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                                                is_causal=True)  # fmt: skip
        cp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0,
        )  # fmt: skip


STEPS = {"sdpa": _sdpa_step, "shardzoo_ring": _ring_step, "shardzoo_ring_overlapped": _ring_overlapped_step,
         "torch_ring": _torch_ring_step}
LABELS = {"sdpa": "SDPA (full seq, 1 rank)",
          "shardzoo_ring": "shardzoo ring_attention",
          "shardzoo_ring_overlapped": "shardzoo ring, CUDA dK/dV schedule (grad_tiles=0)",
          "torch_ring": "torch ring core (_templated_ring_attention)"}  # fmt: skip


def measure(method: str, seq: int, heads: int, head_dim: int, reps: int) -> tuple[float, float]:
    """On every rank: (median seconds, smallest peak MiB) of ``reps`` causal fwd + bwd over this
    rank's shard."""
    group = dist.group.WORLD
    local = seq // dist.get_world_size()
    step = STEPS[method]
    times, peaks = [], []
    for _ in range(reps):
        seconds, peak = timed_attention_step(lambda q, k, v, dout: step(q, k, v, dout, group), local, heads, head_dim)
        times.append(seconds)
        peaks.append(peak)
    return statistics.median(times), min(peaks)


def analytic_mib(seq: int, world: int, heads: int, head_dim: int) -> float:
    """Tensors any fwd + bwd must hold per rank: q, k, v, out, dout, dq, dk, dv (fp32)."""
    return 8 * heads * (seq // world) * head_dim * 4 / MIB


def fit_max_seq(points: list[tuple[int, float]], budget_mib: float) -> int | None:
    """Longest sequence under ``budget_mib`` from a least-squares line through (seq, MiB)."""
    if len(points) < 2:
        return None
    xs, ys = zip(*points)
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    if slope <= 0:
        return None
    return int((budget_mib - (mean_y - slope * mean_x)) / slope)


def run(args) -> tuple[list[dict], dict]:
    rows = []
    for world in args.worlds:
        methods = ["shardzoo_ring"] + ([] if args.no_overlapped else ["shardzoo_ring_overlapped"]) + ["torch_ring"]
        if world == 1:
            methods = ["sdpa"] if args.no_ring_on_one_rank else ["sdpa", "shardzoo_ring"]
        with WorkerPool(world, timeout=3600) as pool:
            for method in methods:  # warm-up: imports, thread pools and comm buffers stay out of the peaks
                pool.run(measure, method, 512 * world, args.heads, args.head_dim, 1)
            for seq in args.seqs:
                if seq % (2 * world):
                    continue
                per_rep = {method: [] for method in methods}  # reps interleave the methods, order alternating
                for rep in range(args.reps):
                    for method in methods if rep % 2 == 0 else methods[::-1]:
                        per_rep[method].append(pool.run(measure, method, seq, args.heads, args.head_dim, 1))
                for method in methods:
                    seconds = statistics.median(max(r[0] for r in ranks) for ranks in per_rep[method])
                    peak = min(max(r[1] for r in ranks) for ranks in per_rep[method])
                    row = dict(method=method, world=world, seq=seq, seconds=seconds, peak_mib=peak,
                               analytic_mib=analytic_mib(seq, world, args.heads, args.head_dim))  # fmt: skip
                    rows.append(row)
                    print(f"{LABELS[method]:45s} ranks={world} seq={seq:6d}  {seconds:8.3f} s  "
                          f"peak {peak:8.1f} MiB/rank", flush=True)  # fmt: skip
    fits = {}
    for method in STEPS:
        for world in args.worlds:
            points = [(r["seq"], r["peak_mib"]) for r in rows if r["method"] == method and r["world"] == world]
            if points:
                fits[f"{method}@{world}"] = fit_max_seq(points, args.budget_mib)
    return rows, fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--no-ring-on-one-rank", action="store_true", help="skip ring_attention on 1 rank")
    parser.add_argument("--no-overlapped", action="store_true",
                        help="skip the ring with the CUDA dK/dV schedule (overlapped hops, whole-block kernel calls)")
    parser.add_argument("--budget-mib", type=float, default=512.0, help="per-rank memory budget for the max-length fit")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense causal rows above")
    parser.add_argument("--packed", action="store_true", help="packed documents: ring / Ulysses vs per-document SDPA")
    parser.add_argument("--packed-tokens", type=int, default=32768)
    parser.add_argument("--packed-seed", type=int, default=0, help="seed of the document lengths")
    parser.add_argument("--gqa-bytes", action="store_true", help="bytes per rank, 4:1 GQA vs repeated kv heads")
    parser.add_argument("--gqa-heads", type=int, default=16, help="query heads of the GQA byte count (kv: a quarter)")
    parser.add_argument("--gqa-seq", type=int, default=4096, help="sequence length of the GQA byte count")
    args = parser.parse_args()
    if args.packed or args.gqa_bytes:
        run_packed_and_gqa(args)
    if args.no_dense:
        return
    load_before = os.getloadavg()[0]
    rows, fits = run(args)
    table_md, fit_md = _tables(rows, fits, args)
    print(f"\n{table_md}\n\n{fit_md}")
    note = (
        f"Causal, batch 1, heads {args.heads}, head_dim {args.head_dim}, fp32, zigzag shards; median of "
        f"{args.reps} reps, slowest rank. Peak = max over ranks of the rank process's VmHWM during one fwd + bwd "
        "minus its RSS before the inputs were allocated (MALLOC_MMAP_THRESHOLD_ pinned so freed tensors leave "
        "RSS); it counts inputs, outputs, grads, activations, temporaries and comm buffers. All ranks share this "
        "machine's cores (1 rank: all cores; P ranks: cores / P threads each), so time shows overhead, not "
        f"speed-up; 1-minute load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run "
        "(other jobs shared the machine, so times are noisy). torch's ring core runs on CPU only when called "
        "directly (context_parallel() dispatches CUDA SDPA ops only); it runs with the ring (all-to-all) "
        "rotater, as its default all-gather rotater holds every rank's K/V. The 'CUDA dK/dV schedule' rows run "
        "ring_attention's GPU backward (grad_tiles=0: overlapped dK/dV hops, one kernel call per block) on the "
        "same CPU ranks, against the CPU schedule that ring_attention picks for CPU tensors.\n\n" + fit_md
    )
    data = {"rows": rows, "max_seq_fit": fits, "args": vars(args)}
    title = "Ring attention vs full attention and torch's ring core (bench/attention.py)"
    write_results("attention", title, table_md, data, note)


def run_packed_and_gqa(args) -> None:
    """The packed and GQA sections (bench/_attention_packed.py), written to their own part of RESULTS.md."""
    from _attention_packed import PACKED_LABELS, run_gqa_bytes, run_packed

    load_before = os.getloadavg()[0]
    pools: dict[int, WorkerPool] = {}

    def pool_for(world: int) -> WorkerPool:
        if world not in pools:
            pools[world] = WorkerPool(world, timeout=3600)
        return pools[world]

    try:
        packed = run_packed(args, pool_for) if args.packed else []
        gqa = run_gqa_bytes(argparse.Namespace(**{**vars(args), "heads": args.gqa_heads}), pool_for) \
            if args.gqa_bytes else []
    finally:
        for pool in pools.values():
            pool.close()
    base = {r["world"]: r for r in packed if r["method"] == "sdpa_docs"}.get(1)
    packed_md = markdown_table(
        ["method", "ranks", "fwd+bwd s", "time / per-doc SDPA", "work max / mean", "same, zigzag over the stream",
         "peak MiB/rank", "floor MiB/rank", "peak / floor"],
        [[PACKED_LABELS[r["method"]], r["world"], f"{r['seconds']:.2f}",
          f"{r['seconds'] / base['seconds']:.2f}" if base else "-", f"{r['work_max_over_mean']:.3f}",
          f"{r['stream_zigzag_max_over_mean']:.3f}", f"{r['peak_mib']:.1f}", f"{r['floor_mib']:.1f}",
          f"{r['peak_mib'] / r['floor_mib']:.2f}"] for r in packed])  # fmt: skip
    gqa_md = markdown_table(
        ["sp", "ranks", "heads : kv heads", "seq", "MiB sent/rank, GQA", "MiB sent/rank, kv repeated", "ratio"],
        [[r["mode"], r["world"], f"{r['heads']}:{r['kv_heads']}", r["seq"], f"{r['gqa_bytes'] / MIB:.2f}",
          f"{r['repeated_bytes'] / MIB:.2f}", f"{r['ratio']:.3f}"] for r in gqa])  # fmt: skip
    docs = packed[0]["docs"] if packed else 0
    note = (
        f"Packed: {args.packed_tokens} tokens in {docs} documents, lengths log-normal (median 512, log-space sd "
        f"1.5, seed {args.packed_seed}), causal within each, batch 1, heads {args.heads}, head_dim {args.head_dim}, "
        f"fp32; median of {args.reps} interleaved reps, slowest rank. Work = visible (query, key) pairs per rank "
        "(max over mean), for the per-document split used and for zigzag over the packed stream. Floor = q, k, v, "
        "out and their gradients at the longest shard. Peak memory as in the dense section. All ranks share this "
        f"machine's cores; 1-minute load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after. GQA: "
        "bytes from comm.count() around one causal fwd + bwd, batch 1, fp32, head_dim "
        f"{args.head_dim}; the ring sends only kv heads (exactly 1/4), Ulysses also sends q and out "
        "(2 * heads + 2 * P * max(kv_heads / P, 1) heads' worth per all-to-all round, docs/sequence_parallel.md)."
    )
    title = "Packed documents and grouped-query attention (bench/attention.py --packed --gqa-bytes)"
    write_results("attention_packed", title, packed_md + "\n\n" + gqa_md, {"packed": packed, "gqa": gqa}, note)


def _tables(rows: list[dict], fits: dict, args) -> tuple[str, str]:
    """The per-run table and the max-length table, as markdown."""
    sdpa = {r["seq"]: r for r in rows if r["method"] == "sdpa"}
    table = []
    for r in rows:
        base = sdpa.get(r["seq"])
        table.append([
            LABELS[r["method"]], r["world"], r["seq"], f"{r['seconds']:.3f}",
            f"{r['seconds'] / base['seconds']:.2f}" if base else "-", f"{r['peak_mib']:.1f}",
            f"{r['peak_mib'] / base['peak_mib']:.2f}" if base else "-", f"{r['analytic_mib']:.1f}",
        ])  # fmt: skip
    headers = ["method", "ranks", "seq", "fwd+bwd s", "time / SDPA", "peak MiB/rank", "peak / SDPA",
               "q,k,v,o + grads MiB/rank"]  # fmt: skip
    sdpa_fit, ring_fit = fits.get("sdpa@1"), fits.get("shardzoo_ring@1")
    fit_rows = []
    for key, value in fits.items():
        method, world = key.split("@")
        ratio = f"{value / sdpa_fit:.2f}" if value and sdpa_fit else "-"
        vs_ring = f"{value / ring_fit:.2f}" if value and ring_fit else "-"
        fit_rows.append([LABELS[method], world, value if value is not None else "-", ratio, vs_ring])
    fit_headers = ["method", "ranks", f"longest seq in {args.budget_mib:.0f} MiB/rank (linear fit)", "vs SDPA",
                   "vs ring_attention on 1 rank"]
    return markdown_table(headers, table), markdown_table(fit_headers, fit_rows)


if __name__ == "__main__":
    main()
