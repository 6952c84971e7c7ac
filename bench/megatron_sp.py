"""Megatron sequence parallelism in 1d: a transformers Llama block stack split by
``shardzoo.parallelize`` in 1d tp=4, trained with it off (the activations between the blocks'
tp layers replicated over tp) and on (split along the sequence), in one pool of ranks.

Per rank it measures the peak activation memory of a training step (the live tensors at the
step's peak, less parameters, gradients and optimizer state, as torch's ``MemTracker`` sorts
them: what autograd saves and what is transient) and the step time, and prints them next to the
planner's prediction for the same layout (``shardzoo.planner.api.price`` with
``sequence_parallel`` off and on: its activation term plus its workspace; and its whole peak
less the process runtime, against the tracker's whole peak). Timed runs alternate the variants,
repeated ``--reps`` times, with an A/A control (off again) whose ratio to off is this host's
noise; ratios are medians of paired ratios.

    python bench/megatron_sp.py [--layers 4] [--hidden 256] [--batch 8] [--seq 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import markdown_table, write_results  # noqa: E402

MIB = 2**20
VARIANTS = ("off", "on", "off (A/A control)")


def llama_config(args) -> dict:
    """LlamaConfig fields of the block stack (a small vocabulary: the blocks dominate)."""
    return dict(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                intermediate_size=args.ffn, num_hidden_layers=args.layers, vocab_size=args.vocab,
                max_position_embeddings=args.seq, tie_word_embeddings=False, attention_dropout=0.0)


def spec_of(args, sequence_parallel: bool) -> dict:
    return dict(hf=dict(model_type="llama", config=llama_config(args)),
                layout=dict(dp=1, pp=1, sp=1, tp=args.tp, tp_mode="1d", tp_depth=1), batch=args.batch,
                seq=args.seq, steps=args.steps, sequence_parallel=sequence_parallel)


def activation_peak(peak: dict) -> int:
    """Live bytes at the step's peak less parameters, gradients, optimizer state and buffers."""
    return peak["act"] + peak["temp"] + peak["other"]


def predicted(args, hw, sequence_parallel: bool) -> dict:
    """The planner's activation peak (its activation term and workspace), whole peak less the
    process runtime, and step seconds for the layout."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardzoo.planner.api import price
    from shardzoo.planner.walked import walked_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **llama_config(args)))
    priced = price(walked_model(model), args.tp, args.batch, args.seq, f"tp={args.tp}", hardware=hw, dtype="fp32",
                   sequence_parallel=sequence_parallel)
    cand = priced.candidate
    m = max((r.memory for r in cand.reports), key=lambda b: b.peak)
    return dict(activation=m.activations + m.workspace, tensors=m.peak - m.runtime, step_s=cand.step_seconds)


def _versus(predicted_bytes: int, measured_bytes: int) -> str:
    return f"{predicted_bytes / MIB:.1f} ({(predicted_bytes - measured_bytes) / measured_bytes:+.1%})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="training steps per timed run, the first a warm-up")
    ap.add_argument("--reps", type=int, default=3, help="rounds of the three variants, in alternating order")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--cached-hardware", action="store_true",
                    help="reuse the cached calibration instead of measuring this host again before the runs")
    args = ap.parse_args(argv)
    from _measure import run_layout, tracked_memory

    from shardzoo.comm.workers import WorkerPool
    from shardzoo.planner.calibration import calibrate

    hw = calibrate(use_cache=args.cached_hardware)
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    memory: dict[str, dict] = {}
    with WorkerPool(args.tp, timeout=args.timeout) as pool:
        for v in ("off", "on"):
            got = pool.run(tracked_memory, spec_of(args, v == "on"))
            memory[v] = max(got, key=activation_peak)
            act = activation_peak(memory[v])
            print(f"{v}: peak {memory[v]['total'] / MIB:.1f} MiB of tensors, activations {act / MIB:.1f}", flush=True)
        for rep in range(args.reps):
            for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                runs[v].append(max(r["step_s"] for r in pool.run(run_layout, spec_of(args, v == "on"))))
                print(f"rep {rep} {v}: step {runs[v][-1]:.3f} s", flush=True)
    memory[VARIANTS[2]] = memory["off"]
    pred = {v: predicted(args, hw, v == "on") for v in ("off", "on")}
    rows, data = [], {"args": vars(args), "hardware": hw.name, "variants": {}, "step_s_per_round": runs}
    for v in VARIANTS:
        p, mem = pred["on" if v == "on" else "off"], memory[v]
        act = activation_peak(mem)
        entry = dict(step_s=statistics.median(runs[v]),
                     step_ratio=statistics.median(a / b for a, b in zip(runs[v], runs["off"])),
                     activation_bytes=act, activation_ratio=act / activation_peak(memory["off"]),
                     tensor_peak_bytes=mem["total"], memory=mem, predicted=p)
        data["variants"][v] = entry
        rows.append([v, f"{entry['step_s']:.3f}", f"{entry['step_ratio']:.3f}", f"{act / MIB:.1f}",
                     f"{entry['activation_ratio']:.3f}", _versus(p["activation"], act), f"{mem['total'] / MIB:.1f}",
                     _versus(p["tensors"], mem["total"]), f"{p['step_s']:.3f}"])
    headers = ["Megatron SP", "step s (median)", "step / off (paired)", "activation peak MiB / rank",
               "activation / off", "planner's activation peak MiB (error)", "tensor peak MiB / rank",
               "planner's peak less runtime MiB (error)", "planner step s"]
    table = markdown_table(headers, rows)
    print(table)
    cfg, source = llama_config(args), hw.source.split(":")[0]
    note = (f"transformers LlamaForCausalLM ({args.layers} blocks, hidden {cfg['hidden_size']}, {args.heads} heads, "
            f"intermediate {args.ffn}, vocabulary {args.vocab}), fp32, split by shardzoo.parallelize in 1d "
            f"tp={args.tp}, "
            f"batch {args.batch} x {args.seq} tokens, AdamW, one pool of {args.tp} ranks on this host's cores. Memory: "
            f"one step after a warm-up, under torch.distributed._tools.mem_tracker.MemTracker on every rank, worst "
            f"rank; the activation peak is the live tensors at the step's peak less parameters, gradients, optimizer "
            f"state and buffers (saved for backward, and transient). The A/A row repeats off's memory; its timings "
            f"are runs of their own. Timing: {args.reps} rounds of the three variants in alternating order, "
            f"{args.steps - 1} timed steps per run after a warm-up step, slowest rank, median. The planner: "
            f"shardzoo.planner.api.price on this host's calibration ({source}); its activation peak is its "
            f"activation term plus its workspace.")
    write_results("megatron_sp", "Megatron sequence parallelism in 1d: activation memory and step time "
                  "(bench/megatron_sp.py)", table, data, note)


if __name__ == "__main__":
    main()
