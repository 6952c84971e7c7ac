"""Pipeline schedules as the planner prices them (docs/planner.md, "Pipeline schedules").

For each schedule ``shardzoo.pipeline`` runs, two numbers per rank:

* the bubble: a step's pipeline part is ``m * max_k t_k + fill * (sum_k t_k - max_k t_k)``,
  with ``t_k`` a stage's forward and backward of one micro-batch and ``fill`` the fraction of a
  stage's time each other stage adds while the pipeline fills and drains;
* the activations in flight: how many micro-batches' worth of a whole stage's saved
  activations a rank holds at its peak, as torch's schedule orders its passes.

The zero-bubble schedules split a stage's backward into its input gradients ``B`` and its
weight gradients ``W`` (with its forward ``F``; ``F + B + W = t``), and fill the bubble with
deferred ``W`` passes. Their bubbles are the published ones, in the time of one chunk:
ZB-H1 (Qi et al. 2023) ``(pp - 1)(F + B - W)``, ZB-V ``(pp - 1)(F + B - 2W)`` and DualPipeV
(DeepSeek-V3 report, Table 2, with forward and backward not overlapped)
``(pp - 1)(F + 2B - 3W)``, none below zero.
"""

from __future__ import annotations

from fractions import Fraction

# the planner's names -> (shardzoo.pipeline's name, chunks per rank: None for any v >= 2)
SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("interleaved_1f1b", None),
             "zero_bubble": ("zero_bubble", None), "zbv": ("zbv", 2), "dualpipev": ("dualpipev", 2)}
ALIASES = {"interleaved_1f1b": "interleaved"}  # shardzoo.pipeline's names the planner also takes


def schedule_name(schedule: str, virtual_stages: int) -> str:
    """The planner's name for ``schedule`` (either naming), checked against ``virtual_stages``."""
    name = ALIASES.get(schedule, schedule)
    if name not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {sorted(SCHEDULES)} (or 'interleaved_1f1b')")
    chunks = SCHEDULES[name][1]
    v = virtual_stages
    good = v == chunks if chunks is not None else isinstance(v, int) and v >= 2
    if not good:
        want = f"virtual_stages={chunks}" if chunks is not None else "virtual_stages >= 2"
        raise ValueError(f"schedule={schedule!r} with virtual_stages={v!r}: it takes {want}; pass that")
    return name


def fill_fraction(schedule: str, virtual_stages: int, forward: float, inputs: float, weights: float) -> float:
    """Fraction of each other stage's ``t = forward + inputs + weights`` (seconds of one
    micro-batch: F, B and W) that ``schedule`` adds to a step while filling and draining."""
    t = forward + inputs + weights
    if schedule in ("gpipe", "1f1b") or t <= 0:
        return 1.0
    v = virtual_stages
    chunk = {"interleaved": t, "zero_bubble": forward + inputs - weights, "zbv": forward + inputs - 2 * weights,
             "dualpipev": forward + 2 * inputs - 3 * weights}[schedule]
    return max(0.0, chunk) / t / v


def in_flight(schedule: str, stage: int, pp: int, micro_batches: int, virtual_stages: int = 1) -> Fraction:
    """Micro-batches of a whole stage's activations rank ``stage`` holds at once: GPipe all m,
    1F1B ``pp - stage``; with v chunks of 1 / v stage each, the chunks torch's schedule has run
    forward and not yet finished backward (the weight pass, where it is split off) at its peak:
    interleaved 1F1B ``(v - 1) pp + 2 (pp - 1 - stage) + 1`` (Narayanan et al. 2021: ``pp (1 +
    (pp - 1) / (pp v))`` stages on the first rank), zero bubble ``v pp`` (its deferred weight
    passes keep every chunk's activations), ZB-V ``min(2 pp, m + 1 + stage)``, DualPipeV ``2 pp
    + 1``. At most all m."""
    m, v = micro_batches, virtual_stages
    if pp == 1:
        return Fraction(1)
    if schedule == "gpipe":
        return Fraction(m)
    chunks = {"1f1b": None, "interleaved": (v - 1) * pp + 2 * (pp - 1 - stage) + 1, "zero_bubble": v * pp,
              "zbv": min(2 * pp, m + 1 + stage), "dualpipev": 2 * pp + 1}[schedule]
    held = Fraction(pp - stage) if chunks is None else Fraction(chunks, v)
    return min(held, Fraction(m))


# what ``plan`` enumerates for pp > 1 on hosts that price every schedule: each schedule once,
# at 2 chunks per rank where it takes several. GPipe is left out: its bubble is 1F1B's and it
# holds all m micro-batches in flight, so it never beats 1F1B (ties go to the smaller peak)
ENUMERATED = (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2))


def chunk_rule(schedule: str, virtual_stages: int, pp: int, micro_batches: int, layers: int) -> str | None:
    """Why ``schedule`` with ``virtual_stages`` chunks per rank cannot be priced for this pp,
    micro-batch count and block count (None: it can): several chunks need pp >= 2, m a
    multiple of pp and the blocks split evenly into pp * v chunks (the planner prices even
    chunks); torch's DualPipeV needs a micro-batch per stage, m >= pp * v."""
    v = virtual_stages
    if v == 1:
        return None
    if pp < 2 or micro_batches % pp or layers % (pp * v):
        return (f"schedule={schedule!r} needs pp >= 2, micro_batches a multiple of pp and the {layers} blocks split "
                f"evenly into pp * v = {pp * v} chunks; got pp={pp}, micro_batches={micro_batches}, virtual_stages={v}")
    if schedule == "dualpipev" and micro_batches < pp * v:
        return (f"schedule='dualpipev' needs at least one micro-batch per stage (torch's DualPipeV): micro_batches >= "
                f"pp * v = {pp * v}; got micro_batches={micro_batches}")
    return None
