"""1D tensor parallelism: one transformer MLP block (LayerNorm, fc1, GELU, fc2, residual; fwd + bwd)
with shardzoo's 1D layers vs PyTorch DTensor tensor parallelism vs a raw all_reduce floor.

Per world size (one launch each, all three implementations in it, interleaved step by step):

* shardzoo: LayerNorm1D -> ParallelLinear1D(column) -> GELU -> ParallelLinear1D(row).
* DTensor: the same nn.Module parallelised with ``parallelize_module`` on ``mesh.sub_mesh("tp")``
  (ColwiseParallel / RowwiseParallel; with sequence parallelism SequenceParallel on the norm,
  ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))).
* floor: the local matmuls and exactly one raw torch.distributed collective each way
  (all_reduce; with sequence parallelism all_gather + reduce_scatter), no wrappers.
* control: the floor once more in each step, whose ratio to the floor shows the host's noise.

Activations are [batch, seq, hidden]; with sequence parallelism the block's input and output
are the rank's [batch, seq/p, hidden] chunk.

    python bench/tp1d.py                                            # h=1024 ffn=4096 B=8 S=512
    python bench/tp1d.py --hidden 256 --ffn 1024 --seq 128 --steps 5   # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import markdown_table, write_results  # noqa: E402

import shardzoo  # noqa: E402
from shardzoo.comm.ops import _ALL_GATHER, _REDUCE_SCATTER  # noqa: E402


class MLPBlock(nn.Module):
    def __init__(self, norm, fc1, fc2):
        super().__init__()
        self.norm, self.fc1, self.fc2 = norm, fc1, fc2

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def serial_block(h, ffn, dtype):
    return MLPBlock(nn.LayerNorm(h, dtype=dtype), nn.Linear(h, ffn, dtype=dtype), nn.Linear(ffn, h, dtype=dtype))


def shardzoo_block(serial, mesh, sp):
    from shardzoo.layers.linear_1d import ParallelLinear1D
    from shardzoo.layers.norm_1d import LayerNorm1D

    return MLPBlock(LayerNorm1D.from_serial(serial.norm, mesh, sequence_parallel=sp),
                    ParallelLinear1D.from_serial(serial.fc1, mesh, style="column", sequence_parallel=sp),
                    ParallelLinear1D.from_serial(serial.fc2, mesh, style="row", sequence_parallel=sp))


def dtensor_block(serial, mesh, sp):
    import copy

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    block = copy.deepcopy(serial)
    if sp:
        plan = {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                "fc2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return parallelize_module(block, mesh.sub_mesh("tp"), plan)


class _RawEnter(torch.autograd.Function):
    """Identity forward; one raw all_reduce backward (or SP: all_gather fwd / reduce_scatter bwd)."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp = sp
        if not sp:
            return x.view_as(x)
        p = dist.get_world_size()
        out = x.new_empty((p * x.shape[0],) + tuple(x.shape[1:]))
        _ALL_GATHER(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if not ctx.sp:
            dist.all_reduce(g)
            return g, None
        out = g.new_empty((g.shape[0] // dist.get_world_size(),) + tuple(g.shape[1:]))
        _REDUCE_SCATTER(out, g)
        return out, None


class _RawLeave(torch.autograd.Function):
    """One raw all_reduce forward (or SP: reduce_scatter fwd / all_gather bwd)."""

    @staticmethod
    def forward(ctx, y, sp):
        ctx.sp = sp
        y = y.contiguous()
        if not sp:
            dist.all_reduce(y)
            return y
        out = y.new_empty((y.shape[0] // dist.get_world_size(),) + tuple(y.shape[1:]))
        _REDUCE_SCATTER(out, y)
        return out

    @staticmethod
    def backward(ctx, g):
        if not ctx.sp:
            return g, None
        out = g.new_empty((dist.get_world_size() * g.shape[0],) + tuple(g.shape[1:]))
        _ALL_GATHER(out, g.contiguous())
        return out, None


class FloorBlock(nn.Module):
    """Local weights and raw collectives; SP moves the sequence dim first so the raw
    collectives (which work on dim 0) need no copies beyond the transposes."""

    def __init__(self, serial, rank, p, sp):
        super().__init__()
        self.sp = sp
        self.norm = serial.norm
        self.w1 = nn.Parameter(serial.fc1.weight.detach().chunk(p, 0)[rank].clone())
        self.b1 = nn.Parameter(serial.fc1.bias.detach().chunk(p, 0)[rank].clone())
        self.w2 = nn.Parameter(serial.fc2.weight.detach().chunk(p, 1)[rank].clone())
        self.b2 = nn.Parameter(serial.fc2.bias.detach().clone())

    def forward(self, x):
        h = self.norm(x)
        if self.sp:
            h = _RawEnter.apply(h.transpose(0, 1), True).transpose(0, 1)
        else:
            h = _RawEnter.apply(h, False)
        y = F.linear(F.gelu(F.linear(h, self.w1, self.b1)), self.w2)
        if self.sp:
            y = _RawLeave.apply(y.transpose(0, 1), True).transpose(0, 1)
        else:
            y = _RawLeave.apply(y, False)
        return x + y + self.b2


def _step(block, x, gy):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = block(x)
    y.backward(gy)
    return y


CONTROL = "floor again (control)"


def run(cfg):
    """On every rank: median step ms of each implementation, parameter bytes, max output diff."""
    p = dist.get_world_size()
    mesh = shardzoo.ParallelMesh(tp=p)
    torch.manual_seed(0)
    dtype = getattr(torch, cfg["dtype"])
    h, ffn, b, s = cfg["hidden"], cfg["ffn"], cfg["batch"], cfg["seq"]
    serial = serial_block(h, ffn, dtype)
    serial_bytes = sum(t.numel() * t.element_size() for t in serial.parameters())
    out = []
    for sp in (False, True):
        blocks = {"shardzoo": shardzoo_block(serial, mesh, sp), "dtensor": dtensor_block(serial, mesh, sp),
                  "floor": FloorBlock(serial, mesh.tp_rank, p, sp)}
        blocks[CONTROL] = blocks["floor"]  # A/A control: its ratio to the floor is this host's noise
        s_local = s // p if sp else s
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(b, s, h, generator=gen, dtype=dtype)
        gy = torch.randn(b, s, h, generator=gen, dtype=dtype)
        chunk = slice(mesh.tp_rank * s_local, (mesh.tp_rank + 1) * s_local)
        x_in, gy_in = (x[:, chunk].contiguous(), gy[:, chunk].contiguous()) if sp else (x, gy)
        times = {k: [] for k in blocks}
        outputs = {}
        names = list(blocks)
        for i in range(cfg["warmup"] + cfg["steps"]):
            # interleaved, first one rotating, so load drifts and order effects hit all alike
            for name in names[i % len(names):] + names[:i % len(names)]:
                block = blocks[name]
                dist.barrier()
                t0 = time.perf_counter()
                y = _step(block, x_in, gy_in)
                dist.barrier()
                if i >= cfg["warmup"]:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                y = y.full_tensor() if hasattr(y, "full_tensor") else y
                outputs[name] = y.detach()
        # a step is as slow as its slowest rank
        steps = torch.tensor([times[n] for n in names], dtype=torch.float64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        for k, (name, block) in enumerate(blocks.items()):
            local = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
                        for t in block.parameters())
            out.append({"world": p, "sp": sp, "impl": name, "step_ms": statistics.median(steps[k].tolist()),
                        "min_ms": min(steps[k].tolist()), "steps_ms": steps[k].tolist(),
                        "param_bytes": local, "serial_bytes_over_tp": serial_bytes // p,
                        "max_diff_vs_floor": float((outputs[name] - outputs["floor"]).abs().max())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    # Ranks start with the allocator pinned (buffers up to 32 MiB from the heap, kept there), so no
    # implementation pays page faults for its activations that another happens to avoid.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
    cfg = vars(args)
    rows, data = [], []
    for world in args.worlds:
        data += shardzoo.launch(run, world, cfg, timeout=3600)[0]  # every rank returns the same rows

    def paired(r, other):  # median over steps of this step's time / the other's in the same step
        o = next(d for d in data if (d["world"], d["sp"], d["impl"]) == (r["world"], r["sp"], other))
        return statistics.median(a / b for a, b in zip(r["steps_ms"], o["steps_ms"]))

    for r in data:
        r["vs_floor"], r["vs_dtensor"] = paired(r, "floor"), paired(r, "dtensor")
        rows.append([r["world"], "on" if r["sp"] else "off", r["impl"], f"{r['step_ms']:.1f}", f"{r['min_ms']:.1f}", f"{r['vs_floor']:.2f}",
                     f"{r['vs_dtensor']:.2f}", f"{r['param_bytes']:,}", f"{r['serial_bytes_over_tp']:,}",
                     f"{r['max_diff_vs_floor']:.1e}"])
    headers = ["tp", "seq parallel", "impl", "median step ms", "min step ms", "vs floor", "vs DTensor", "param bytes / rank",
               "serial bytes / tp", "max abs diff vs floor"]
    table = markdown_table(headers, rows)
    print(table)
    controls = ", ".join(f"{r['vs_floor']:.2f}" for r in data if r["impl"] == CONTROL)
    full = (args.hidden, args.ffn, args.batch, args.seq) == (1024, 4096, 8, 512)
    size = (f"h={args.hidden} ffn={args.ffn} batch={args.batch} seq={args.seq} {args.dtype}, fwd+bwd, "
            f"{args.steps} timed steps after {args.warmup} warm-up")
    note = (f"{size}{'' if full else ' (reduced size, not the full h=1024 ffn=4096 8x512 block)'}. "
            "Step times are the slowest rank's. Ratios are the median over steps of the paired ratio (all "
            "implementations run back to back in each step, in rotating order), so drifts of the shared machine "
            "cancel within a step. The control row runs the floor a second time in each step: its distance from "
            f"1.00 ({controls}) is the resolution of this host. Floor = local matmuls + one raw collective each way. Param bytes include the replicated LayerNorm "
            "and row bias, hence slightly above serial/tp.")
    write_results("tp1d", "1D tensor parallelism: MLP block vs DTensor and a raw all_reduce floor", table,
                  {"config": cfg, "rows": data}, note)


if __name__ == "__main__":
    main()
