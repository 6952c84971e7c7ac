"""One transformer MLP block (LayerNorm, fc1, GELU, fc2, residual; fwd + bwd) in every tp mode.

World 8: 1D tp=8 (Megatron column/row, ParallelLinear1D), 2.5D q=2 d=2, 3D q=2.
World 4: 1D tp=4, 2D q=2.

Per mode: bytes sent per rank measured with ``shardzoo.comm.count`` next to the closed form of
docs/tp_modes.md (they must agree exactly; the run fails otherwise), parameter bytes and
saved-activation bytes per rank, and the median step time relative to 1D at the same world.

    python bench/tp_modes.py                                   # B=8 S=64 h=256 ffn=1024 fp32
    python bench/tp_modes.py --batch 8 --seq 16 --hidden 64 --ffn 256 --steps 3   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from fractions import Fraction as Fr
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardzoo.layers.tensor_layout import layout_of  # noqa: E402
from shardzoo.planner.volumes import mlp_block_bytes, mlp_param_bytes  # noqa: E402 - the docs/tp_modes.md closed forms
from shardzoo.testing.grid import MLPBlock, parallel_mlp  # noqa: E402

CONFIGS = [  # (world, label, ParallelMesh kwargs)
    (8, "1d tp=8", dict(tp=8, tp_mode="1d")),
    (8, "2.5d q=2 d=2", dict(tp=8, tp_mode="2.5d", tp_depth=2)),
    (8, "3d q=2", dict(tp=8, tp_mode="3d")),
    (4, "1d tp=4", dict(tp=4, tp_mode="1d")),
    (4, "2d q=2", dict(tp=4, tp_mode="2d")),
]


# -- the block on each rank ----------------------------------------------------------------------
def build(mesh, hidden, ffn, seed):
    """(parallel block, enter, leave): the MLP block x + fc2(gelu(fc1(ln(x)))) built by the mode's
    layout object from one serial block; enter / leave move a full activation in and out."""
    torch.manual_seed(seed)
    serial = MLPBlock(nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden))
    layout = layout_of(mesh)
    return parallel_mlp(serial, mesh), layout.shard_input, layout.gather_output


def saved_activation_bytes(block, x):
    """Bytes of the tensors autograd keeps for backward (parameters excluded, storages counted once)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def run_mode(mesh_kwargs, batch, seq, hidden, ffn, steps, seed):
    """On every rank: measured bytes, memory and step times of one mode (a dict)."""
    from shardzoo import ParallelMesh, comm

    mesh = ParallelMesh(**mesh_kwargs)
    block, enter, _ = build(mesh, hidden, ffn, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x_full, g_full = torch.randn(batch, seq, hidden, generator=gen), torch.randn(batch, seq, hidden, generator=gen)
    x, g = enter(x_full).detach().requires_grad_(True), enter(g_full).detach()

    def step():
        block(x).backward(g)

    step()  # warm-up (also creates any lazily built groups)
    with comm.count() as counter:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return dict(bytes=counter.total_bytes, by_kind={k: str(v) for k, v in counter.bytes.items()},
                param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
                activation_bytes=saved_activation_bytes(block, x), step_s=statistics.median(times))


def main(argv=None):
    from _results import markdown_table, write_results
    from shardzoo.comm.workers import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    shape = (args.batch, args.seq, args.hidden, args.ffn)
    rows, results, pools = [], [], {}
    try:
        for world, label, kwargs in CONFIGS:
            if world not in pools:
                pools[world] = WorkerPool(world, timeout=1200)
            per_rank = pools[world].run(run_mode, kwargs, *shape, args.steps, 0)
            mode, q, d = kwargs["tp_mode"], (8 if world == 8 else 4) if kwargs["tp_mode"] == "1d" else 2, kwargs.get("tp_depth", 1)
            formula = mlp_block_bytes(mode, *shape, q=q, d=d)
            measured = per_rank[0]["bytes"]
            if any(r["bytes"] != formula for r in per_rank):
                raise SystemExit(f"{label}: measured bytes {[str(r['bytes']) for r in per_rank]} != formula {formula}")
            assert all(r["param_bytes"] == mlp_param_bytes(mode, args.hidden, args.ffn, q) for r in per_rank), label
            step = max(r["step_s"] for r in per_rank)
            results.append(dict(world=world, mode=label, bytes_measured=str(measured), bytes_formula=str(formula),
                                by_kind=per_rank[0]["by_kind"], param_bytes=per_rank[0]["param_bytes"],
                                activation_bytes=max(r["activation_bytes"] for r in per_rank), step_ms=1e3 * step))
    finally:
        for pool in pools.values():
            pool.close()
    base = {r["world"]: r["step_ms"] for r in results if r["mode"].startswith("1d")}
    for r in results:
        r["time_vs_1d"] = r["step_ms"] / base[r["world"]]
        rows.append([r["world"], r["mode"], f"{int(Fr(r['bytes_measured'])):,}", f"{int(Fr(r['bytes_formula'])):,}",
                     "yes" if r["bytes_measured"] == r["bytes_formula"] else "NO", f"{r['param_bytes']:,}",
                     f"{r['activation_bytes']:,}", f"{r['step_ms']:.1f}", f"{r['time_vs_1d']:.2f}"])
    headers = ["world", "mode", "bytes sent/rank", "formula", "exact", "param bytes/rank", "saved act. bytes/rank",
               "median step ms", "time vs 1D"]
    table = markdown_table(headers, rows)
    print(table)
    b, s, h, f = shape
    by = {r["mode"].split()[0]: r for r in results}
    one_d = {r["world"]: r for r in results if r["mode"].startswith("1d")}

    def vs_1d(mode, key):
        r = by[mode]
        return float(Fr(r[key]) / Fr(one_d[r["world"]][key]))

    note = (f"MLP block B={b} S={s} h={h} ffn={f} fp32, forward + backward; bytes under the ring model of "
            f"shardzoo/comm/accounting.py equal the docs/tp_modes.md formulas in every mode; median of {args.steps} "
            f"steps, max over ranks, gloo on one shared CPU host (times are indicative only). Against 1D at the same "
            f"world, 2D / 2.5D / 3D send {vs_1d('2d', 'bytes_measured'):.2f}x / {vs_1d('2.5d', 'bytes_measured'):.2f}x / "
            f"{vs_1d('3d', 'bytes_measured'):.2f}x the bytes and keep {vs_1d('2d', 'activation_bytes'):.2f}x / "
            f"{vs_1d('2.5d', 'activation_bytes'):.2f}x / {vs_1d('3d', 'activation_bytes'):.2f}x the saved activations "
            f"per rank: at q=2 SUMMA moves the input and weight blocks of both linears three times, 1D only the "
            f"h-wide activations twice.")
    write_results("tp_modes", "Tensor-parallel modes: MLP block (bench/tp_modes.py)", table,
                  dict(shape=dict(batch=b, seq=s, hidden=h, ffn=f, dtype="fp32"), results=results), note)


if __name__ == "__main__":
    main()
