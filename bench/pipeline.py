"""Pipelines of a transformers model: ``shardzoo.parallelize`` cuts a transformers GPT-2 into
stages and ``shardzoo.pipeline`` runs them; measured against shardzoo's own GPT-2 family of the
same size run by its stage builder and ``build_schedule``, in one pool of ranks.

1. Step time, transformers GPT-2 / family GPT-2 at the same pp, schedule, micro-batches and
   batch: paired ratios of alternating runs, with an A/A control (the transformers model again)
   whose ratio is this host's noise; beside each, the same two models on one rank without a
   pipeline, whose ratio is the part that is the models' own code rather than the pipeline. Both
   compute the tanh GELU with torch's one kernel (transformers' ``gelu_pytorch_tanh``; its
   ``gelu_new`` is the same function in five elementwise ops, 13% slower on one rank here).
2. The bubble of each schedule at pp 2 and 4: ``1 - T1 / (pp * Tpp)``, T1 the step of the same
   model and batch on one rank (no pipeline) and Tpp the pipelined step, every rank with one
   intra-op thread (so one rank computes as fast as one stage's rank), each Tpp run right after a
   T1 run and the bubble the median of the pairs' (this host's speed drifts), next to the ideal of the
   planner's schedule model (``ideal_bubble``: 1F1B's ``(pp - 1) / (m + pp - 1)``, interleaved
   ``(pp - 1) / (v m + pp - 1)``, the zero-bubble schedules' with F = B = W). With more ranks
   than cores the ranks share cores, so an idle rank's bubble partly lends its core to another:
   read pp 4 on a 2-core host as an ordering of the schedules, not a fraction.
3. ``from_pretrained`` with pp: the RSS a rank adds while it builds, allocates and reads its
   stage, over the bytes of the stage's parameters.

    python bench/pipeline.py [--hidden 256] [--layers 8] [--batch 8] [--seq 256] [--micro 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import markdown_table, write_results  # noqa: E402

LOAD_HIDDEN = (512, 1024)  # from_pretrained: two stage sizes, to tell a fixed overhead from a proportional one

VARIANTS = ("family GPT2, build_schedule", "transformers GPT-2, shardzoo.pipeline",
            "transformers GPT-2 again (A/A control)")
# schedule: (virtual stages, placement)
SCHEDULES = {"gpipe": (1, "loop"), "1f1b": (1, "loop"), "interleaved_1f1b": (2, "loop"), "zero_bubble": (2, "loop"),
             "zbv": (2, "v")}


def gpt2_fields(args) -> dict:
    # gelu_pytorch_tanh: the tanh GELU of GPT-2's gelu_new in one kernel, as the family computes it
    # (transformers' gelu_new runs it as five elementwise ops: 13% of a one-rank step here)
    return dict(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab,
                n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                activation_function="gelu_pytorch_tanh")


def spec(args, variant: str, pp: int, schedule: str = "1f1b") -> dict:
    base = dict(layout=dict(dp=1, pp=pp, sp=1, tp=1, tp_mode="1d", tp_depth=1), batch=args.batch, seq=args.seq,
                steps=args.steps, micro_batches=args.micro if pp > 1 else 1, threads=1)
    if variant.startswith("family"):
        return dict(base, family="gpt2", config=gpt2_fields(args))
    v, placement = SCHEDULES[schedule]
    return dict(base, hf=dict(model_type="gpt2", config=gpt2_fields(args)), schedule=schedule, virtual_stages=v,
                placement=placement)


def ideal_bubble(pp: int, m: int, schedule: str) -> float:
    """The bubble the planner's schedule model gives with the stages alike and a backward's
    input and weight passes each as long as the forward: ``fill (pp - 1) / (m + fill (pp - 1))``
    (1F1B: ``(pp - 1) / (m + pp - 1)``; interleaved: ``(pp - 1) / (v m + pp - 1)``; ZB-V: 0)."""
    from shardzoo.planner.schedules import ALIASES, fill_fraction

    fill = fill_fraction(ALIASES.get(schedule, schedule), SCHEDULES[schedule][0], 1.0, 1.0, 1.0)
    return fill * (pp - 1) / (m + fill * (pp - 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="steps per timed run, the first a warm-up")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    from _measure import pretrained_peak, run_layout

    data = {"args": vars(args), "versus": None, "bubble": {}}

    from shardzoo.comm.workers import WorkerPool

    def slowest(pool, s) -> float:
        return max(r["step_s"] for r in pool.run(run_layout, s))

    # the same two models on one rank, no pipeline: the part of the ratio that is the models' own code
    runs, alone = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    with WorkerPool(1, timeout=args.timeout) as single, WorkerPool(2, timeout=args.timeout) as pool:
        for rep in range(args.reps):
            for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                runs[v].append(slowest(pool, spec(args, v, 2)))
                alone[v].append(slowest(single, spec(args, v, 1)))
                print(f"rep {rep} {v}: step {runs[v][-1]:.3f} s, one rank {alone[v][-1]:.3f} s", flush=True)
    family, family_alone = runs[VARIANTS[0]], alone[VARIANTS[0]]
    rows = [[v, f"{statistics.median(t):.3f}", f"{statistics.median(a / b for a, b in zip(t, family)):.3f}",
             f"{statistics.median(alone[v]):.3f}", f"{statistics.median(a / b for a, b in zip(alone[v], family_alone)):.3f}"]
            for v, t in runs.items()]
    versus = markdown_table(["model", "pp=2 1f1b step s (median)", "/ family (paired)", "one rank step s (median)",
                             "/ family (paired)"], rows)
    print(versus)
    data.update(versus=runs, alone=alone)

    bubbles = []
    for pp in (2, 4):
        with WorkerPool(1, timeout=args.timeout) as single, WorkerPool(pp, timeout=args.timeout) as pool:
            for schedule, (v, _) in SCHEDULES.items():
                # T1 measured right beside each Tpp, so a drift of this host's speed hits both alike
                pairs = [(slowest(single, spec(args, "transformers", 1)),
                          slowest(pool, spec(args, "transformers", pp, schedule))) for _ in range(args.reps)]
                t = statistics.median(tpp for _, tpp in pairs)
                one = statistics.median(t1 for t1, _ in pairs)
                measured = statistics.median(1 - t1 / (pp * tpp) for t1, tpp in pairs)
                ideal = ideal_bubble(pp, args.micro, schedule)
                data["bubble"][f"{pp}/{schedule}"] = dict(step_s=t, one_rank_s=one, measured=measured, ideal=ideal,
                                                          pairs=pairs)
                bubbles.append([pp, schedule, v, f"{one:.3f}", f"{t:.3f}", f"{measured:.3f}", f"{ideal:.3f}"])
                print(bubbles[-1], flush=True)
    bubble = markdown_table(["pp", "schedule", "v", "T1 s", "Tpp s", "bubble 1 - T1 / (pp Tpp), paired median",
                             "ideal"], bubbles)
    print(bubble)

    loads, data["from_pretrained"] = [], []
    for hidden in LOAD_HIDDEN:
        with tempfile.TemporaryDirectory() as tmp:
            import torch
            import transformers

            torch.manual_seed(0)
            fields = dict(gpt2_fields(args), n_embd=hidden, n_layer=8, vocab_size=16384)
            transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).save_pretrained(tmp)
            with WorkerPool(2, timeout=args.timeout) as pool:
                got = pool.run(pretrained_peak, tmp, dict(dp=1, pp=2, sp=1, tp=1, tp_mode="1d", tp_depth=1), None)
        for r in got:
            loads.append([hidden, r["stage"], f"{r['stage_bytes'] / 2**20:.1f}", f"{r['peak_added'] / 2**20:.1f}",
                          f"{(r['peak_added'] - r['stage_bytes']) / 2**20:.1f}", f"{r['peak_added'] / r['stage_bytes']:.3f}"])
            data["from_pretrained"].append(dict(r, hidden=hidden))
    load = markdown_table(["hidden", "stage", "stage parameters MiB", "RSS added at peak MiB", "above the stage MiB",
                           "ratio"], loads)
    print(load)
    note = (f"GPT-2 ({args.layers} blocks, hidden {args.hidden}, {args.heads} heads, vocabulary {args.vocab}, tanh GELU "
            f"in one kernel for both models), fp32, "
            f"batch {args.batch} x {args.seq} tokens in {args.micro} micro-batches, AdamW, dropout 0, one intra-op thread "
            f"per rank; slowest rank, "
            f"median of {args.reps} runs of {args.steps - 1} timed steps after a warm-up; a bubble is the median over the "
            f"{args.reps} (T1, Tpp) pairs, each Tpp run right after its T1. from_pretrained: GPT-2 of "
            f"8 blocks, hidden {' and '.join(map(str, LOAD_HIDDEN))}, vocabulary 16384, cut in 2 stages: the RSS a rank "
            f"adds above its stage's bytes is about the same at both sizes (the stage's modules and the loader's "
            f"buffers), so the ratio falls as the stage grows.")
    write_results("pipeline", "Pipelines of a transformers model (bench/pipeline.py)",
                  versus + "\n\n" + bubble + "\n\n" + load, data, note)


if __name__ == "__main__":
    main()
