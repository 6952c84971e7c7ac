"""Plans as people read them: the table of the top candidates, why the first one wins, what a
layout costs term by term (``--explain``) and the message when nothing fits."""

from __future__ import annotations

from shardzoo.comm.tp_grids import TP_GRIDS
from shardzoo.planner import time as timing
from shardzoo.planner.advice import memory_text, run_lines
from shardzoo.planner.enumerate import explain
from shardzoo.planner.hardware import GIB

_HEADERS = ["#", "dp", "pp", "sp", "tp", "tp_mode", "ep", "micro", "schedule", "ckpt", "zero", "params GiB", "peak GiB",
            "comm GB/step", "step s", "tokens/s", "fits"]


def schedule_text(c) -> str:
    """A candidate's pipeline schedule as the table shows it ("-" without a pipeline)."""
    if c.layout["pp"] == 1:
        return "-"
    several = c.virtual_stages > 1 and c.schedule in ("interleaved", "zero_bubble")  # zbv, dualpipev: always 2
    return c.schedule + (f" v={c.virtual_stages}" if several else "")


def table(candidates, start: int = 1) -> str:
    """One row per candidate; the ep column only where some candidate splits experts."""
    rows = []
    for i, c in enumerate(candidates, start):
        lay = c.layout
        mode = lay["tp_mode"] + (f" d={lay['tp_depth']}" if TP_GRIDS[lay["tp_mode"]].has_depth else "")
        rows.append([str(i), str(lay["dp"]), str(lay["pp"]), str(lay["sp"]), str(lay["tp"]), mode,
                     str(lay.get("ep", 1)), str(c.micro_batches), schedule_text(c),
                     "on" if c.activation_checkpointing else "off", str(c.zero),
                     f"{c.param_bytes_per_rank / GIB:.2f}", f"{c.peak_bytes_per_rank / GIB:.2f}",
                     f"{float(c.comm_bytes_per_rank_per_step) / 1e9:.3f}", f"{c.step_seconds:.4g}",
                     f"{c.tokens_per_second:,.0f}", "yes" if c.fits else "no"])
    keep = [k for k, h in enumerate(_HEADERS) if h != "ep" or any(r[k] != "1" for r in rows)]
    headers, rows = [_HEADERS[k] for k in keep], [[r[k] for k in keep] for r in rows]
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers)] + [line(r) for r in rows])


def pipeline_factor(cand, report) -> float:
    """How many micro-batch times of the slowest stage (``report``) the step's pipeline part
    lasts: m + pp - 1 for alike stages on accelerators, less where a time-shared host lends idle
    cores (the host model's pipeline_seconds)."""
    per_step = max(r.step_seconds for r in cand.reports)
    return (cand.step_seconds - per_step) / report.micro_seconds


def comm_by_group(plan, cand) -> list[tuple[str, float, float, str]]:
    """(group, GB per step, seconds per step, link) of the candidate's worst-time stage."""
    from shardzoo.planner.evaluate import Candidate

    candidate = Candidate(**cand.layout, micro_batches=cand.micro_batches, virtual_stages=cand.virtual_stages,
                          schedule=cand.schedule)
    report = max(cand.reports, key=lambda r: r.micro_seconds)
    costs = plan.pricer.distinct_stages(candidate)
    one, step = plan.pricer.traffic(dict(costs)[report.stage], candidate, report.stage,
                                    cand.activation_checkpointing, cand.zero)
    strides, hw = timing.axis_strides(**cand.layout), plan.hardware
    per_micro_batch, per_step = plan.pricer.links(candidate, costs)
    groups: dict = {}
    # bytes: m micro-batches and the step's own; seconds: as the step was priced (Pricer.links)
    for traffic, times, path, links in ((one, candidate.micro_batches, pipeline_factor(cand, report), per_micro_batch),
                                        (step, 1, 1, per_step)):
        for axes, n, messages in traffic.links(hw.backend):
            bandwidth, latency = timing.link(axes, strides, plan.hardware)
            name = "x".join(axes)
            gb, secs, _ = groups.get(name, (0.0, 0.0, ""))
            kind = "intra-node" if bandwidth == plan.hardware.intra_bandwidth else "inter-node"
            per_byte, per_message = links.per_group(axes)
            groups[name] = (gb + n * times / 1e9, secs + (n * per_byte + messages * per_message) * path, kind)
    return sorted(((k, *v) for k, v in groups.items()), key=lambda g: -g[2])


def why(plan, cand) -> str:
    """One line on why ``cand`` (the first candidate) comes first."""
    fitting = sum(1 for c in plan if c.fits) if len(plan) == plan.count else None
    report = max(cand.reports, key=lambda r: r.micro_seconds)
    pp, m = cand.layout["pp"], cand.micro_batches
    compute = report.compute_seconds * pipeline_factor(cand, report)
    # 1F1B / GPipe: (pp - 1) / (m + pp - 1); the schedules of several chunks: the idle share of
    # the pipeline part as priced (schedules.fill_fraction)
    bubble = (pp - 1) / (m + pp - 1) if cand.virtual_stages == 1 else 1 - m / pipeline_factor(cand, report)
    sched = f" ({schedule_text(cand)})" if pp > 1 else ""
    groups = comm_by_group(plan, cand)
    comm = sum(g[2] for g in groups)
    top = f"; most of it over {groups[0][0]} ({groups[0][3]}, {groups[0][2]:.3g} s)" if groups else ""
    of = f" of {fitting} that fit" if fitting is not None else " that fits"
    return (f"why #1: fastest candidate{of} in {plan.memory_gib:g} GiB: per step ~{compute:.3g} s compute and "
            f"~{comm:.3g} s communication{top}; pipeline bubble {bubble:.0%}{sched}; "
            f"{memory_text(cand)}")


def run_text(plan, cand) -> str:
    """The lines that run ``cand`` (advice.run_lines), indented under a heading."""
    return "\n".join(["run #1 (on every rank; config: the model's config):"] +
                      [f"  {line}" for line in run_lines(plan, cand)])


def nothing_fits(plan) -> str:
    best = min(plan, key=lambda c: c.peak_bytes_per_rank)
    return (f"nothing fits in {plan.memory_gib:g} GiB per device: the smallest peak is "
            f"{best.peak_bytes_per_rank / GIB:.2f} GiB, needed by {best.describe()}. Use more devices, a smaller "
            f"global batch or sequence, or devices with more memory")


def explain_text(plan, text: str) -> str:
    """What ``--explain LAYOUT`` prints: why the layout was dropped, or its candidates and the
    first one's costs term by term."""
    found, pruned = explain(plan.problem, text)
    lines = [f"--explain {text}:"]
    for p in pruned:
        lines.append(f"  not legal: {p.what}: {p.reason}")
    if not found:
        if not pruned:
            lines.append(f"  no legal layout matches; sizes left out are inferred, tp_mode is 1d unless given (e.g. "
                         f"--explain dp=2,pp=1,sp=1,tp=4,tp_mode=2d)")
        return "\n".join(lines)
    mine = [c for c in plan if any(c.layout == f.mesh_kwargs() and c.micro_batches == f.micro_batches for f in found)]
    lines.append(f"  {len(mine)} candidates:")
    lines.append(table(mine))
    if mine:
        c = mine[0]
        lines.append(f"  {c.describe()}: {memory_text(c, 3)}")
        for name, gb, secs, kind in comm_by_group(plan, c):
            lines.append(f"    {name:>18}: {gb:10.4f} GB per step, {secs:.4g} s ({kind})")
        lines.append("  run it (on every rank; config: the model's config):")
        lines += [f"    {line}" for line in run_lines(plan, c)]
    return "\n".join(lines)
