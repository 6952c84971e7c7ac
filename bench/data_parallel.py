"""ZeRO on the dp axis: per-rank bytes and step time of DDP and ZeRO 1/2/3 (shardzoo.data_parallel)
on a 1D tensor-parallel MLP stack, next to the ZeRO paper's formulas and plain torch.

Per world (dp x tp=2, one launch each, every implementation in it, steps interleaved):

* ddp, zero1, zero2, zero3: L blocks (LayerNorm1D -> ParallelLinear1D column -> GELU -> row)
  in an ``nn.ModuleList``, wrapped by ``shardzoo.data_parallel(model, mesh, zero=...)``, AdamW
  (``shardzoo.zero_optimizer``).
* torch: the same serial blocks, ``parallelize_module`` (Colwise / Rowwise DTensor TP) on the tp
  submesh, then ``fully_shard`` per block and the root on the dp submesh: the torchtitan way.
* control: a second DDP model in each step; its ratio to ddp is the host's resolution.

Bytes: sum of this rank's local parameter, gradient and optimizer-state tensors after a step,
and the rise of peak RSS while the implementation was built and took its first steps.
Formulas (Rajbhandari et al., Ψ = parameters of this rank's tp piece, N_d = dp): fp32 AdamW
holds 4Ψ + 4Ψ + 8Ψ; stage 1 divides the 8Ψ, stage 2 also the gradients, stage 3 everything.

    python bench/data_parallel.py                                  # h=512, 4 blocks
    python bench/data_parallel.py --hidden 64 --blocks 2 --steps 3  # quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import markdown_table, reset_peak_rss, rss_kib, write_results  # noqa: E402

import shardzoo  # noqa: E402
from shardzoo.layers.dp_shard import local_tensor  # noqa: E402

IMPLS = ["ddp", "zero1", "zero2", "zero3", "torch", "control"]


class Block(nn.Module):
    def __init__(self, norm, fc1, fc2):
        super().__init__()
        self.norm, self.fc1, self.fc2 = norm, fc1, fc2

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def serial_stack(h, blocks):
    torch.manual_seed(0)
    return Stack([Block(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)) for _ in range(blocks)])


def shardzoo_stack(serial, mesh):
    from shardzoo.layers.linear_1d import ParallelLinear1D
    from shardzoo.layers.norm_1d import LayerNorm1D

    model = Stack([Block(LayerNorm1D.from_serial(b.norm, mesh), ParallelLinear1D.from_serial(b.fc1, mesh, style="column"),
                         ParallelLinear1D.from_serial(b.fc2, mesh, style="row")) for b in serial.layers])
    model.mesh = mesh
    return model


def torch_stack(serial, mesh):
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(serial)
    for block in model.layers:
        parallelize_module(block, mesh.sub_mesh("tp"), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    dp = mesh.sub_mesh("dp")
    for block in model.layers:
        fully_shard(block, mesh=dp)
    return fully_shard(model, mesh=dp)


def build(name, serial, mesh):
    if name == "torch":
        model = torch_stack(serial, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    zero = {"ddp": 0, "control": 0, "zero1": 1, "zero2": 2, "zero3": 3}[name]
    model = shardzoo.data_parallel(shardzoo_stack(serial, mesh), mesh, zero=zero)
    return model, shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=1e-3)


def _step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def state_bytes(opt) -> int:
    state = opt.optim.state if hasattr(opt, "optim") else opt.state  # ZeroRedundancyOptimizer: its partition
    return sum(_bytes(s.values()) for s in state.values())


def run(cfg):
    mesh = shardzoo.ParallelMesh(dp=dist.get_world_size() // 2, tp=2)
    serial = serial_stack(cfg["hidden"], cfg["blocks"])
    psi = sum(p.numel() for p in shardzoo_stack(serial, mesh).parameters())  # this rank's tp piece
    gen = torch.Generator().manual_seed(1 + mesh.dp_rank)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], generator=gen)
    impls, rows = {}, {}
    for name in IMPLS:  # built one after another so each RSS rise is its own
        gc.collect()
        base = reset_peak_rss()
        model, opt = build(name, serial, mesh)
        for _ in range(2):
            _step(model, opt, x)
        rss = (rss_kib("VmHWM") - base) * 1024
        params = list(model.parameters())
        rows[name] = {"params": _bytes(params), "grads": _bytes(p.grad for p in params), "state": state_bytes(opt),
                      "rss_rise": rss}
        impls[name] = (model, opt)
    times = {n: [] for n in IMPLS}
    for i in range(cfg["warmup"] + cfg["steps"]):
        for name in IMPLS[i % len(IMPLS):] + IMPLS[:i % len(IMPLS)]:  # rotating order
            dist.barrier()
            t0 = time.perf_counter()
            _step(*impls[name], x)
            dist.barrier()
            if i >= cfg["warmup"]:
                times[name].append((time.perf_counter() - t0) * 1e3)
    steps = torch.tensor([times[n] for n in IMPLS], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    for k, name in enumerate(IMPLS):
        rows[name].update(steps_ms=steps[k].tolist(), dp=mesh.dp_size, psi=psi)
    return rows


def formula(name, psi, n):
    full = {"ddp": (4, 4, 8), "control": (4, 4, 8), "zero1": (4, 4, 8 / n), "zero2": (4, 4 / n, 8 / n),
            "zero3": (4 / n, 4 / n, 8 / n), "torch": (4 / n, 4 / n, 8 / n)}[name]
    return [int(f * psi) for f in full]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    cfg = vars(args)
    table, data = [], {}
    for dp in args.dps:
        rows = shardzoo.launch(run, dp * 2, cfg, timeout=3600)[0]
        data[dp] = rows

        def paired(name, other):
            return statistics.median(a / b for a, b in zip(rows[name]["steps_ms"], rows[other]["steps_ms"]))

        for name in IMPLS:
            r = rows[name]
            want = formula(name, r["psi"], dp)
            table.append([dp, name, f"{r['params']:,}", f"{r['grads']:,}", f"{r['state']:,}",
                          f"{want[0]:,} / {want[1]:,} / {want[2]:,}", f"{r['rss_rise'] / 2**20:.1f}",
                          f"{statistics.median(r['steps_ms']):.1f}", f"{paired(name, 'ddp'):.2f}",
                          f"{paired(name, 'torch'):.2f}"])
    headers = ["dp", "impl", "param bytes", "grad bytes", "optim state bytes", "formula p / g / os",
               "peak RSS rise MiB", "median step ms", "vs ddp", "vs torch"]
    md = markdown_table(headers, table)
    print(md)
    note = (f"tp=2 (1D), h={args.hidden} ffn={4 * args.hidden} blocks={args.blocks} batch={args.batch}/dp rank "
            f"seq={args.seq} fp32 AdamW, {args.steps} timed steps after {args.warmup} warm-up. Bytes are per rank after "
            "a step (zero2 reshards parameters after backward, so between steps they are sharded as in zero3; it holds "
            "them whole from forward to backward). The formula column is ZeRO's 4Ψ/4Ψ/8Ψ for fp32 AdamW, Ψ = this "
            "rank's tp piece; small replicated tensors (LayerNorm, row bias) shard unevenly. Ratios: median over steps "
            "of the paired ratio within a step; the control row is a second DDP model (host resolution). torch = "
            "DTensor TP + FSDP2 per block (torchtitan's way); RSS rise is the high-water mark while building and "
            "taking two steps, which includes the allocator's reuse of earlier frees; the first row (ddp) also pays the "
            "process's one-time allocations (thread pools, gloo buffers), so compare RSS among the later rows.")
    write_results("data_parallel", "ZeRO stages vs DDP and plain torch FSDP2 + DTensor (bench/data_parallel.py)", md,
                  {"config": cfg, "rows": data}, note)


if __name__ == "__main__":
    main()
