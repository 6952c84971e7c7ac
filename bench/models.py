"""GPT-2 training throughput per layout against the serial model, pipeline bubble against the
ideal (p-1)/(m+p-1), and per-rank parameter memory.

    python bench/models.py                       # worlds 4 and 8 on local ranks (gloo / NCCL)
    python bench/models.py --steps 3 --layers 4 --hidden 128

Tokens/s counts the global batch per step (median step time after a warm-up step). The bubble
of a pipelined layout is measured on each rank as 1 - busy / T_schedule: T_schedule the time
of ``schedule.step`` alone (no optimizer), busy the time the same rank takes to run the forward
and backward of its stage on all m microbatches back to back (the inputs the schedule fed it,
captured in the warm-up step), with every rank doing so at once so the cores are shared as in
the schedule. Transfers and schedule overheads count as bubble, as in the ideal formula's
pipeline the stages only wait. Reported: the mean over ranks.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import markdown_table, write_results  # noqa: E402

CORES = os.cpu_count() or 1
# name -> ParallelMesh kwargs
LAYOUTS = {
    "serial": dict(),
    "1d tp2": dict(tp=2),
    "pp2": dict(pp=2),  # fits a 2-core host: its bubble is measured without time-sharing
    "1d tp4": dict(tp=4),
    "2d tp4": dict(tp=4, tp_mode="2d"),
    "1d tp2 x sp2": dict(tp=2, sp=2),
    "pp2 x 1d tp2": dict(pp=2, tp=2),
    "1d tp8": dict(tp=8),
    "2.5d tp8 (d=2)": dict(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d tp8": dict(tp=8, tp_mode="3d"),
    "pp2 x 2d tp4": dict(pp=2, tp=4, tp_mode="2d"),
}


def world(kwargs) -> int:
    return kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("sp", 1) * kwargs.get("dp", 1)


def run_layout(kwargs, args):
    from shardzoo import ParallelMesh
    from shardzoo.comm.mesh import default_device
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads

    mesh = ParallelMesh(**kwargs)
    device = default_device(mesh)  # CUDA under NCCL, else CPU
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    stage = (mesh.pp_rank, mesh.pp_size) if mesh.pp_size > 1 else None
    options = {}
    if args.sequence_parallel == "off":  # Megatron SP (1d, tp > 1): on by default where the checkout has it
        if "sequence_parallel" not in inspect.signature(GPT2.__init__).parameters:
            raise SystemExit("--sequence-parallel off: this checkout's GPT2 has no sequence_parallel argument")
        options["sequence_parallel"] = False
    model = GPT2(config, mesh=mesh, stage=stage, seed=0, device=device, **options)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    captured = {}  # the first microbatch a stage sees in the warm-up step, for the busy time

    def loss_fn(out, target, **loss_kwargs):  # num_targets: the step's count, from the schedule
        captured.setdefault("target", target)
        return model.loss(out, target, **loss_kwargs)

    def remember_input(module, call_args, call_kwargs):
        captured.setdefault("input", (call_args, call_kwargs))

    schedule = None
    if stage:
        model.register_forward_pre_hook(remember_input, with_kwargs=True)
        schedule = build_schedule([(mesh.pp_rank, model)], mesh, n_microbatches=args.microbatches, loss_fn=loss_fn)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    inputs, target = model.shard_input(ids[:, :-1]) if model.is_first else None, None
    if model.is_last:
        target = model.shard_target(ids[:, 1:])
    times, schedule_times = [], []
    for _ in range(args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        if schedule is not None:
            schedule.step(*((inputs,) if model.is_first else ()), **({"target": target} if model.is_last else {}))
            schedule_times.append(time.perf_counter() - start)
            sync_tied_grads([model], mesh)
        else:
            model.loss(model(inputs), target).backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    peak = torch.tensor([float(param_bytes)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result = {"step_s": statistics.median(times[1:]), "param_mib": peak.item() / 2**20}
    if schedule is not None:
        busy = [stage_busy(model, captured, args.microbatches) for _ in range(args.steps)]
        bubble = torch.tensor([1 - statistics.median(busy) / statistics.median(schedule_times[1:])])
        dist.all_reduce(bubble)
        result["bubble"] = bubble.item() / dist.get_world_size()
    opt.zero_grad()
    return result


def stage_busy(model, captured, microbatches: int) -> float:
    """Seconds this rank's stage computes forward + backward of ``microbatches`` microbatches
    with no pipeline around it (every rank measures at once, sharing the cores as in a step)."""
    call_args, call_kwargs = captured["input"]
    call_args = [a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in call_args]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(microbatches):
        out = model(*call_args, **call_kwargs)
        if model.is_last:
            model.loss(out, captured["target"]).backward()
        else:
            out.backward(torch.ones_like(out))
    busy = time.perf_counter() - start
    dist.barrier()
    return busy


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-world", type=int, default=8)
    p.add_argument("--sequence-parallel", choices=("default", "off"), default="default",
                   help="off: Megatron sequence parallelism off in the 1d layouts (on by default)")
    p.add_argument("--only", help="run this one layout and print its step time (bench/models_vs.py)")
    p.add_argument("--json", help="with --only: write the layout's result to this file")
    args = p.parse_args()
    from shardzoo import launch

    if args.only is not None:
        if args.only not in LAYOUTS:
            raise SystemExit(f"--only {args.only!r} is not a layout of this benchmark: {', '.join(LAYOUTS)}")
        result = launch(run_layout, world(LAYOUTS[args.only]), LAYOUTS[args.only], args)[0]
        print(f"{args.only}: step {result['step_s'] * 1e3:.1f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({args.only: result}, f)
        return
    layouts = {n: k for n, k in LAYOUTS.items() if world(k) <= args.max_world}
    results = {}
    for name, kwargs in layouts.items():
        results[name] = launch(run_layout, world(kwargs), kwargs, args)[0]
        print(f"{name:16s} world {world(kwargs)}  step {results[name]['step_s'] * 1e3:8.1f} ms", flush=True)
    tokens = args.batch * args.seq
    serial = results["serial"]["step_s"]
    rows = []
    for name, r in results.items():
        bubble, ideal = "", ""
        if "bubble" in r:
            pp, m = layouts[name]["pp"], args.microbatches
            # more ranks than cores: ranks idle in the bubble lend their core to the others, so
            # the measured busy time is inflated and the figure means little
            over = world(layouts[name]) > CORES and not torch.cuda.is_available()
            bubble = f"{r['bubble']:.2f}" + (" (oversubscribed)" if over else "")
            ideal = f"{(pp - 1) / (m + pp - 1):.2f}"
        rows.append([name, world(layouts[name]), f"{tokens / r['step_s']:,.0f}", f"{serial / r['step_s']:.2f}",
                     bubble, ideal, f"{r['param_mib']:.2f}"])
    headers = ["layout", "world", "tokens/s", "vs serial", "bubble", "ideal bubble", "params MiB/rank (max)"]
    table = markdown_table(headers, rows)
    print(table)
    note = (f"GPT-2 n_layer={args.layers}, n_embd={args.hidden}, n_head={args.heads}, vocab={args.vocab}, "
            f"seq={args.seq}, batch={args.batch}, {args.microbatches} microbatches (1F1B); fp32 AdamW steps. "
            "On a CPU host with fewer cores than ranks the ranks time-share cores, so the ratios say "
            "nothing about scaling; run on GPUs for that. Bubble: 1 - busy / schedule.step time per rank (mean "
            "over ranks), busy = the same rank's stage forward + backward over the m microbatches without the "
            "pipeline, every rank at once (see the module docstring); ideal = (p-1)/(m+p-1). "
            f"'oversubscribed': more ranks than this host's {CORES} cores, where ranks waiting in the bubble lend "
            "their cores to the others, so that figure is not a bubble measurement.")
    write_results("models", "Models: GPT-2 training per layout", table, {"args": vars(args), "results": results},
                  note)


if __name__ == "__main__":
    main()
