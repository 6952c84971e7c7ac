"""Shared by the benchmarks: machine description and writing results (JSON + RESULTS.md section)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"


def machine() -> str:
    """One line naming the hardware and software the numbers come from."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()} {cores} cores, {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def command() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, title: str, table_md: str, data: dict, note: str = "") -> None:
    """Write ``bench/results/<name>.json`` and replace this benchmark's section of RESULTS.md
    (between ``<!-- name:start -->`` and ``<!-- name:end -->``), leaving other sections alone."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out_dir = BENCH_DIR / "results"
    out_dir.mkdir(exist_ok=True)
    payload = {"date": stamp, "machine": machine(), "command": command(), **data}
    tmp = out_dir / f"{name}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(out_dir / f"{name}.json")
    section = (
        f"<!-- {name}:start -->\n## {title}\n\n{stamp} · {machine()} · `{command()}`\n\n"
        f"{table_md}\n\n{note}\n<!-- {name}:end -->".rstrip() + "\n"
    )
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmark results\n\nLatest run of each benchmark in `bench/`.\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + section.rstrip("\n") + "\n" + after
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS_MD.write_text(text)


def rss_kib(field: str = "VmRSS") -> int:
    """This process's ``field`` of /proc/self/status in KiB (VmRSS: now, VmHWM: high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the high-water mark (VmHWM) to the current RSS; returns that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")



def timed_attention_step(step, local: int, heads: int, head_dim: int) -> tuple[float, float]:
    """(seconds, peak MiB) of ``step(q, k, v, dout)`` on fresh [1, heads, local, head_dim]
    inputs, between two barriers of the default group (the slowest rank's time). Peak = the
    high-water RSS during the step minus the RSS before the inputs were allocated."""
    import gc
    import time

    import torch.distributed as dist

    gc.collect()
    reset_peak_rss()
    base = rss_kib("VmRSS")
    q, k, v = (torch.randn(1, heads, local, head_dim, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, heads, local, head_dim)
    dist.barrier()
    start = time.perf_counter()
    step(q, k, v, dout)
    dist.barrier()
    seconds = time.perf_counter() - start
    return seconds, (rss_kib("VmHWM") - base) / 1024
