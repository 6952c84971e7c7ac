"""GPT-2 training throughput per layout, this checkout against another shardzoo checkout (a
release, or the commit before a change), paired, with an A/A control.

    git worktree add /tmp/base <rev>
    python bench/models_vs.py --baseline /tmp/base --pairs 3 --layers 4 --hidden 128

Each layout runs ``bench/models.py --only <layout>`` as a fresh process per measurement, the
checkout chosen by ``PYTHONPATH``: baseline (B), this checkout (A), this checkout again (A'),
in rotating order so drifts of a shared host fall on each alike. Reported per layout: the
median over pairs of tokens/s A / B, and of A' / A (the control: its distance from 1 is this
host's noise for that layout). ``--sequence-parallel off`` runs this checkout with Megatron
sequence parallelism off in the 1d layouts (the baseline as it is): the structure's own cost,
apart from the collectives sequence parallelism adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import markdown_table, write_results  # noqa: E402
from models import LAYOUTS  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_seconds(checkout: str, layout: str, args) -> float:
    """Median step time of ``layout`` run by ``checkout``'s shardzoo (one fresh launch)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": checkout}
        cmd = [sys.executable, os.path.join(HERE, "bench", "models.py"), "--only", layout, "--json", out.name,
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
               "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)]
        if checkout != args.baseline:  # the baseline runs its own defaults
            cmd += ["--sequence-parallel", args.sequence_parallel]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.load(open(out.name))[layout]["step_s"]


def revision(checkout: str) -> str:
    """The commit ``checkout`` is at, with "+ changes" when its tree differs from it."""
    def git(*cmd):
        return subprocess.run(["git", "-C", checkout, *cmd], capture_output=True, text=True).stdout.strip()
    rev = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    return rev + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="root of the shardzoo checkout to compare with")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sequence-parallel", choices=("default", "off"), default="default",
                   help="off: this checkout runs with Megatron sequence parallelism off (the baseline as it is)")
    args = p.parse_args()
    if not os.path.isdir(os.path.join(args.baseline, "shardzoo")):
        raise SystemExit(f"--baseline {args.baseline} holds no shardzoo/ package; pass a checkout's root "
                         f"(git worktree add DIR REV)")
    runs = {"B": args.baseline, "A": HERE, "A'": HERE}
    rows, data = [], {}
    for layout in args.layouts:
        times = {k: [] for k in runs}
        for i in range(args.pairs):
            order = list(runs)[i % 3:] + list(runs)[: i % 3]
            for key in order:
                times[key].append(step_seconds(runs[key], layout, args))
        vs = statistics.median(b / a for a, b in zip(times["A"], times["B"]))  # tokens/s A / B
        aa = statistics.median(a / a2 for a, a2 in zip(times["A"], times["A'"]))
        data[layout] = {**times, "a_vs_b": vs, "aa": aa}
        tokens = args.batch * args.seq
        rows.append([layout, f"{tokens / statistics.median(times['B']):,.0f}",
                     f"{tokens / statistics.median(times['A']):,.0f}", f"{vs:.3f}", f"{aa:.3f}"])
        print(rows[-1], flush=True)
    table = markdown_table(["layout", "baseline tokens/s", "this tokens/s", "this / baseline (paired median)",
                            "A/A control"], rows)
    print(table)
    note = (f"Baseline: the checkout at {args.baseline} ({revision(args.baseline)}), this one at {revision(HERE)}; "
            f"{args.pairs} pairs per layout, each measurement a fresh "
            f"launch of bench/models.py --only <layout> (GPT-2 n_layer={args.layers}, n_embd={args.hidden}, "
            f"seq={args.seq}, batch={args.batch}, median of {args.steps} steps after a warm-up); this checkout's "
            f"Megatron sequence parallelism: {args.sequence_parallel}.")
    off = args.sequence_parallel == "off"
    write_results("models_vs_sp_off" if off else "models_vs",
                  "Models: GPT-2 per layout against a baseline checkout"
                  + (", this one with Megatron sequence parallelism off" if off else ""), table,
                  {"args": vars(args), "results": data}, note)


if __name__ == "__main__":
    main()
