"""``shardzoo.plan(...)``: every legal layout of a model on a world, priced and sorted.

    plan = shardzoo.plan("llama3-70b", 4096, 80, 1536, 8192, hardware="a100")
    best = plan[0]                      # a PricedCandidate; plan.to_json() is what --json prints
    best.layout                         # {"dp": ..., "pp": ..., "sp": ..., "tp": ..., "tp_mode": ..., "tp_depth": ...}

Candidates are sorted: those that fit by step time, then the rest by peak memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from shardzoo.comm.tp_grids import TP_GRIDS, TP_MODES
from shardzoo.planner.block_costs import Illegal
from shardzoo.planner.comm import ATTENTION_KERNELS
from shardzoo.planner.enumerate import ZERO_STAGES, Problem, Pruned, candidates
from shardzoo.planner.evaluate import Candidate, Pricer
from shardzoo.planner.calibration import calibrate
from shardzoo.planner.hardware import GIB, Hardware
from shardzoo.planner.presets import CALIBRATED, HARDWARE, load_model
from shardzoo.planner.schedules import ALIASES, ENUMERATED, SCHEDULES, chunk_rule
from shardzoo.planner.time import step_seconds

CANDIDATE_KEYS = ("layout", "micro_batches", "activation_checkpointing", "zero", "param_bytes_per_rank",
                  "peak_bytes_per_rank", "comm_bytes_per_rank_per_step", "step_seconds", "tokens_per_second", "fits",
                  "schedule", "virtual_stages")
DTYPES = {"fp32": (4, 4), "bf16": (2, 4)}  # (activation bytes, parameter bytes): bf16 is autocast, fp32 weights


@dataclass
class PricedCandidate:
    """One layout with its predicted costs (the worst rank's; ``comm_bytes_per_rank_per_step``
    exact, as a Fraction). ``reports`` (not a field): per-stage breakdowns of the stages priced."""

    layout: dict
    micro_batches: int
    activation_checkpointing: bool
    zero: int
    param_bytes_per_rank: int
    peak_bytes_per_rank: int
    comm_bytes_per_rank_per_step: Fraction
    step_seconds: float
    tokens_per_second: float
    fits: bool
    schedule: str = "1f1b"  # the pipeline schedule (schedules.SCHEDULES; pp = 1: "1f1b", unused)
    virtual_stages: int = 1  # model chunks per pipeline rank

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in CANDIDATE_KEYS}
        c = self.comm_bytes_per_rank_per_step
        out["comm_bytes_per_rank_per_step"] = int(c) if c.denominator == 1 else float(c)
        return out

    def describe(self) -> str:
        lay = self.layout
        depth = f" d={lay['tp_depth']}" if TP_GRIDS[lay["tp_mode"]].has_depth else ""
        ep = f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else ""
        sched = ""
        if lay["pp"] > 1:
            sched = f" {self.schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (f"dp={lay['dp']} pp={lay['pp']} sp={lay['sp']} tp={lay['tp']} {lay['tp_mode']}{depth}{ep}, "
                f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}{sched}, "
                f"checkpointing {'on' if self.activation_checkpointing else 'off'}, zero={self.zero}")


class Plan(list):
    """The sorted candidates (a list), with ``hardware``, ``pruned`` (choices dropped and why),
    ``problem``, ``memory_gib``, ``count`` (candidates priced before ``top`` cut the list) and
    ``pricer`` (for breakdowns of a candidate)."""

    def __init__(self, candidates, hardware: Hardware, pruned: list[Pruned], problem: Problem, count: int,
                 memory_gib: float, pricer: Pricer):
        super().__init__(candidates)
        self.hardware, self.pruned, self.problem, self.count = hardware, pruned, problem, count
        self.memory_gib, self.pricer = memory_gib, pricer

    @property
    def fits(self) -> bool:
        """Whether any candidate fits (the first one does, if any)."""
        return bool(self) and self[0].fits

    def to_json(self) -> dict:
        """``{"hardware", "candidates", "pick"}``; ``pick`` (advice.pick_json): the first
        candidate's memory terms in bytes (summing to its peak) and the lines that run it, or
        None when nothing fits."""
        from shardzoo.planner.advice import pick_json

        return {"hardware": self.hardware.to_json(), "candidates": [c.to_json() for c in self],
                "pick": pick_json(self)}


def resolve_hardware(hardware: str | Hardware, nodes: int | None, devices_per_node: int | None, world: int,
                     recalibrate: bool = False) -> Hardware:
    """A preset name, "cpu" / "calibrate" (this host, measured and cached) or a Hardware, with
    the node size set by ``nodes`` (world / nodes devices each) or ``devices_per_node``."""
    if isinstance(hardware, Hardware):
        hw = hardware
    elif hardware in CALIBRATED:
        hw = calibrate(use_cache=not recalibrate)
    elif hardware in HARDWARE:
        hw = HARDWARE[hardware]
    else:
        raise ValueError(f"unknown hardware {hardware!r}; use one of {', '.join(sorted(HARDWARE) + list(CALIBRATED))}")
    if nodes is not None and devices_per_node is not None:
        raise ValueError("pass --nodes or --devices-per-node, not both (nodes = world / devices per node)")
    if nodes is not None:
        if nodes < 1 or world % nodes:
            raise ValueError(f"--nodes {nodes} must divide the world size {world}; choose a divisor of {world}")
        devices_per_node = world // nodes
    if devices_per_node is not None:
        if devices_per_node < 1:
            raise ValueError(f"--devices-per-node {devices_per_node} must be a positive integer")
        hw = dataclasses.replace(hw, devices_per_node=devices_per_node)
    return hw


def _check_inputs(world, device_memory_gib, global_batch, seq, shape, sp_mode, dtype):
    for name, value in (("world", world), ("global_batch", global_batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if not device_memory_gib or device_memory_gib <= 0:
        raise ValueError(f"device_memory_gib={device_memory_gib!r} must be a positive number of GiB")
    if shape.tokens is None and seq > shape.max_seq:
        raise ValueError(f"--seq {seq} exceeds {shape.name or shape.family}'s {shape.max_seq} positions; "
                         f"plan a sequence of at most {shape.max_seq} tokens")
    if sp_mode not in ("ring", "ulysses"):
        raise ValueError(f"sp_mode={sp_mode!r} is not 'ring' or 'ulysses'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")


def tried_schedules(schedule: str | None, hw: Hardware) -> tuple[tuple[str, int], ...]:
    """The (schedule, virtual_stages) pairs ``plan`` tries for pp > 1: ``schedule`` alone (a
    schedule of several chunks per rank at 2), or with None every one of ENUMERATED where the
    host model prices them (accelerator presets), 1F1B elsewhere."""
    from shardzoo.planner.host import DedicatedDevices

    dedicated = type(hw.host) is DedicatedDevices
    if schedule is None:
        return ENUMERATED if dedicated else (("1f1b", 1),)
    name = ALIASES.get(schedule, schedule)
    if name not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {sorted(SCHEDULES)} (or 'interleaved_1f1b')")
    v = SCHEDULES[name][1] or 2
    if v > 1 and not dedicated:
        raise ValueError(f"schedule={schedule!r} (virtual_stages={v}) is priced on accelerator presets only, not on "
                         f"{hw.name!r}; use schedule='1f1b'")
    return ((name, v),)


def price_candidate(pricer: Pricer, candidate: Candidate, costs, checkpointing, zeros,
                    memory_bytes: int) -> list[PricedCandidate]:
    """``candidate`` priced for every (checkpointing, zero) choice."""
    problem = pricer.problem
    tokens = problem.global_batch * (problem.shape.tokens or problem.seq)
    out = []
    for (ckpt, zero), reports in pricer.price(candidate, checkpointing, zeros, costs).items():
        peak = max(r.memory.peak for r in reports)
        seconds = step_seconds(candidate, reports, pricer.hw.host, candidate.schedule)
        cand = PricedCandidate(candidate.mesh_kwargs(), candidate.micro_batches, ckpt, zero,
                               max(r.param_bytes for r in reports), peak,
                               max(reports, key=lambda r: r.comm_scaled).comm_bytes, seconds, tokens / seconds,
                               peak <= memory_bytes, candidate.schedule, candidate.virtual_stages)
        cand.reports = reports
        out.append(cand)
    return out


def plan(model, world: int, device_memory_gib: float, global_batch: int, seq: int, hardware="h100",
         nodes: int | None = None, devices_per_node: int | None = None, top: int | None = None, *,
         sp_mode: str = "ring", schedule: str | None = None, dtype: str | None = None, zero_stages=ZERO_STAGES,
         tp_modes=TP_MODES, checkpointing=(False, True), recalibrate: bool = False, attention: str = "flash",
         sequence_parallel: bool = True) -> Plan:
    """Every legal layout of ``model`` (a preset name, a Hugging Face directory, a ModelShape, or
    an ``nn.Module`` that ``shardzoo.parallelize`` splits, with its default plan and pp = 1;
    ``walked.walked_model(module, plan)`` for another plan), priced from its modules and plan, on ``world``
    devices of ``device_memory_gib`` GiB each, for a global batch of ``global_batch``
    sequences of ``seq`` tokens, priced on ``hardware``; the ``top`` best (all by default). A model
    with experts is tried at every ep (a divisor of dp x sp that divides its expert count).

    ``dtype``: "bf16" (autocast, fp32 weights; default on accelerator presets) or "fp32"
    (default on "cpu" / "calibrate": the host model's ``default_dtype``). ``sp_mode``: attention over sp; ``schedule``: the
    pipeline schedule of pp > 1 candidates, one of ``schedules.SCHEDULES`` (those of several chunks per rank at
    2 chunks), or None: every schedule of ``schedules.ENUMERATED`` on accelerator presets, 1F1B on a CPU host;
    ``attention``: the attention kernel priced (``price``);
    ``sequence_parallel``: Megatron sequence parallelism in 1d with tp > 1 and pp = 1, as
    ``parallelize`` and the families build by default (False: as built with it off)."""
    shape = load_model(model)
    hw = resolve_hardware(hardware, nodes, devices_per_node, world, recalibrate)
    dtype = dtype or hw.host.default_dtype
    _check_inputs(world, device_memory_gib, global_batch, seq, shape, sp_mode, dtype)
    schedules = tried_schedules(schedule, hw)
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTION_KERNELS}")
    e, ep = DTYPES[dtype]
    problem = Problem(shape, world, global_batch, seq, sp_mode, e, ep, hw.host.dropout_mask_bytes(e), attention,
                      sequence_parallel)
    memory_bytes = int(device_memory_gib * GIB)
    pricer = Pricer(problem, hw)
    pruned: list[Pruned] = []
    out: list[PricedCandidate] = []
    shared, costs = None, None
    for candidate in candidates(problem, tp_modes, pruned, schedules):
        # the schedules of one layout come one after another and share its stages (and their sums)
        key = dataclasses.replace(candidate, schedule="1f1b", virtual_stages=1)
        if key != shared:
            shared = key
            try:
                costs = pricer.distinct_stages(candidate)
            except Illegal as err:
                pruned.append(Pruned(str(candidate), str(err)))
                costs = None
        if costs is None:
            continue
        zeros = [z for z in zero_stages if z == 0 or candidate.dp * candidate.sp > 1]  # zero > 0: ranks to shard over
        out += price_candidate(pricer, candidate, costs, checkpointing, zeros, memory_bytes)
    out.sort(key=lambda c: (not c.fits, c.step_seconds if c.fits else c.peak_bytes_per_rank, c.peak_bytes_per_rank))
    return Plan(out[:top] if top else out, hw, pruned, problem, len(out), device_memory_gib, pricer)


@dataclass
class Priced:
    """One named candidate priced alone (``price``): the PricedCandidate, the schedule it was priced
    with, and the model FLOPs of its step (``flops.model_flops``)."""

    candidate: PricedCandidate
    schedule: str
    virtual_stages: int
    model_flops: float
    world: int

    @property
    def step_seconds(self) -> float:
        return self.candidate.step_seconds

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.candidate.tokens_per_second / self.world

    @property
    def model_tflops_per_device(self) -> float:
        """Model FLOPs of a step over its seconds and the devices, in TFLOP/s."""
        return self.model_flops / self.candidate.step_seconds / self.world / 1e12

    def to_json(self) -> dict:
        return {"candidate": self.candidate.to_json(), "schedule": self.schedule,
                "virtual_stages": self.virtual_stages, "step_seconds": self.step_seconds,
                "tokens_per_second_per_device": self.tokens_per_second_per_device,
                "model_flops_per_step": self.model_flops, "model_tflops_per_device": self.model_tflops_per_device}

    def describe(self) -> str:
        return (f"{self.candidate.describe()}: step {self.step_seconds:.4g} s, "
                f"{self.tokens_per_second_per_device:,.0f} tokens/s and {self.model_tflops_per_device:.1f} model "
                f"TFLOP/s per device, peak {self.candidate.peak_bytes_per_rank / GIB:.2f} GiB "
                f"({'fits' if self.candidate.fits else 'does not fit'})")


def _layout_text(layout, world: int) -> str:
    """A layout dict or text with dp left out -> the text ``explain`` reads, dp = world / the rest."""
    from shardzoo.planner.enumerate import parse_candidate

    want = dict(parse_candidate(layout)) if isinstance(layout, str) else dict(layout)
    if "dp" not in want:
        rest = want.get("pp", 1) * want.get("sp", 1) * want.get("tp", 1)
        if rest < 1 or world % rest:
            raise ValueError(f"layout {layout!r}: pp*sp*tp = {rest} does not divide the world size {world}; "
                             f"choose sizes whose product divides {world}")
        want["dp"] = world // rest
    return ",".join(f"{k}={v}" for k, v in want.items() if k != "micro_batches")


def price(model, world: int, global_batch: int, seq: int, layout, *, micro_batches: int | None = None,
          checkpointing: bool = False, zero: int = 0, hardware="h100", nodes: int | None = None,
          devices_per_node: int | None = None, device_memory_gib: float | None = None, sp_mode: str = "ring",
          schedule: str = "1f1b", virtual_stages: int = 1, dtype: str | None = None,
          attention: str = "flash", sequence_parallel: bool = True) -> Priced:
    """``layout`` of ``model`` priced alone, without enumerating the others: the same PricedCandidate
    ``plan`` gives for it, with tokens/s and model TFLOP/s per device (``Priced``).

    ``layout``: ParallelMesh kwargs as a dict or text (``"dp=12,pp=16,tp=8"``; missing sizes
    are 1, dp the rest of the world, tp_mode 1d). ``micro_batches``: default the most the
    replica batch splits into (the smallest bubble). ``schedule``: one of ``shardzoo.pipeline``'s
    (``schedules.SCHEDULES``): "1f1b", "gpipe", "interleaved" (or "interleaved_1f1b") or
    "zero_bubble" with ``virtual_stages`` v >= 2 model chunks per pipeline rank, "zbv" or
    "dualpipev" with v = 2 (their bubble and activations in flight: ``schedules``). ``device_memory_gib``: for
    ``fits``, default the hardware's memory. ``attention``: the kernel priced, "flash" (what
    shardzoo runs: torch's scaled_dot_product_attention) or "materialized" (the score matrix
    written out, as Megatron-LM ran in Narayanan et al. 2021; sp = 1 only). ``sequence_parallel``: as
    for ``plan``."""
    from shardzoo.planner.enumerate import explain
    from shardzoo.planner.flops import model_flops
    from shardzoo.planner.host import DedicatedDevices
    from shardzoo.planner.schedules import schedule_name

    shape = load_model(model)
    hw = resolve_hardware(hardware, nodes, devices_per_node, world)
    dtype = dtype or hw.host.default_dtype
    memory_gib = device_memory_gib if device_memory_gib is not None else hw.memory_bytes / GIB
    v = virtual_stages
    schedule = schedule_name(schedule, v)
    _check_inputs(world, memory_gib, global_batch, seq, shape, sp_mode, dtype)
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not a ZeRO stage {ZERO_STAGES}")
    if v > 1 and type(hw.host) is not DedicatedDevices:
        raise ValueError(f"schedule={schedule!r} (virtual_stages={v}) is priced on accelerator presets only, not on "
                         f"{hw.name!r}; use schedule='1f1b'")
    e, ep = DTYPES[dtype]
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTION_KERNELS}")
    problem = Problem(shape, world, global_batch, seq, sp_mode, e, ep, hw.host.dropout_mask_bytes(e), attention,
                      sequence_parallel)
    text = _layout_text(layout, world)
    found, reasons = explain(problem, text)
    if not found:
        why = "; ".join(f"{p.what}: {p.reason}" for p in reasons[:3]) or "no legal layout matches"
        raise ValueError(f"layout {text} is not legal for {shape.name or shape.family} on {world} devices: {why}")
    counts = sorted(candidate.micro_batches for candidate in found)
    m = micro_batches if micro_batches is not None else counts[-1]
    if m not in counts:
        raise ValueError(f"micro_batches={m!r} does not split {text}'s replica batch of "
                         f"{global_batch // found[0].dp} sequences; choose one of {counts}")
    candidate = dataclasses.replace(next(x for x in found if x.micro_batches == m), virtual_stages=v,
                                    schedule=schedule)
    if zero and candidate.dp * candidate.sp == 1:
        raise ValueError(f"zero={zero} shards over dp x sp, which is 1 in {text}; use zero=0")
    reason = chunk_rule(schedule, v, candidate.pp, m, shape.layers)
    if reason:
        raise ValueError(reason)
    pricer = Pricer(problem, hw)
    costs = pricer.distinct_stages(candidate)
    [cand] = price_candidate(pricer, candidate, costs, (bool(checkpointing),), [zero], int(memory_gib * GIB))
    return Priced(cand, schedule, v, model_flops(shape, global_batch, seq, bool(checkpointing), e, ep), world)
