"""The pipeline schedules as priced (docs/planner.md, "Pipeline schedules"): the activations a
rank holds in flight are those torch's own schedules leave alive, the bubble formulas order
the schedules as their papers do, and ``price`` takes every schedule ``shardzoo.pipeline`` runs."""

from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from shardzoo.planner.api import price
from shardzoo.planner.schedules import fill_fraction, in_flight, schedule_name

TORCH = {"interleaved": (torch_schedules.ScheduleInterleaved1F1B, "loop"),
         "zero_bubble": (torch_schedules.ScheduleInterleavedZeroBubble, "loop"),
         "zbv": (torch_schedules.ScheduleZBVZeroBubble, "v"),
         "dualpipev": (torch_schedules.ScheduleDualPipeV, "v")}
ENDS = ("FULL_BACKWARD", "BACKWARD_WEIGHT")  # a chunk's activations live until its weight pass


def _stage_objects(rank: int, pp: int, v: int, placement: str) -> list:
    """What torch's schedules read of a stage to order the passes (no process group needed)."""
    indices = [rank + k * pp for k in range(v)] if placement == "loop" else [rank, 2 * pp - 1 - rank]
    return [SimpleNamespace(group_size=pp, group_rank=rank, stage_index=i, num_stages=pp * v, is_first=i == 0,
                            is_last=i == pp * v - 1, submod=None, has_backward=True) for i in indices]


def torch_chunks_in_flight(name: str, pp: int, v: int, m: int) -> list[int]:
    """Per rank, the most chunks torch's schedule has run forward and not finished backward."""
    cls, placement = TORCH[name]
    order = cls(_stage_objects(0, pp, v, placement), m, loss_fn=lambda out, target: out).pipeline_order
    peaks = []
    for rank in range(pp):
        live, peak = set(), 0
        actions = [a for a in order[rank] if a is not None]
        while actions:
            a = actions.pop(0)
            kind = a.computation_type.name
            if kind == "OVERLAP_F_B":
                actions[:0] = list(a.sub_actions)
            elif kind == "FORWARD":
                live.add((a.stage_index, a.microbatch_index))
                peak = max(peak, len(live))
            elif kind in ENDS:
                live.discard((a.stage_index, a.microbatch_index))
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("name,v", [("interleaved", 2), ("interleaved", 3), ("zero_bubble", 2), ("zero_bubble", 3),
                                    ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_activations_in_flight_are_those_torch_schedules_keep(name, v, pp):
    for m in (pp, 2 * pp, 4 * pp):
        if name == "dualpipev" and m < 2 * pp:  # torch refuses fewer micro-batches than stages
            continue
        want = torch_chunks_in_flight(name, pp, v, m)
        assert [in_flight(name, k, pp, m, v) * v for k in range(pp)] == want, (name, pp, v, m)


def test_one_chunk_schedules_hold_what_1f1b_and_gpipe_hold():
    assert [in_flight("1f1b", k, 4, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", k, 4, 2) for k in range(4)] == [2, 2, 2, 1]
    assert in_flight("gpipe", 0, 4, 8) == 8 and in_flight("1f1b", 0, 1, 8) == 1


def test_bubbles_order_the_schedules_as_their_papers_do():
    f = b = w = 1.0  # a stage's forward, input and weight gradients alike
    assert fill_fraction("1f1b", 1, f, b, w) == fill_fraction("gpipe", 1, f, b, w) == 1.0
    assert fill_fraction("interleaved", 2, f, b, w) == 0.5
    assert fill_fraction("zero_bubble", 2, f, b, w) == pytest.approx((f + b - w) / 3 / 2)
    assert fill_fraction("zbv", 2, f, b, w) == 0.0 and fill_fraction("dualpipev", 2, f, b, w) == 0.0
    # weight passes too short to fill the bubble leave some of it, never a negative one
    assert 0 < fill_fraction("zbv", 2, 1.0, 1.5, 0.5) < fill_fraction("zero_bubble", 2, 1.0, 1.5, 0.5) < 1
    assert fill_fraction("dualpipev", 2, 1.0, 3.0, 0.1) > 0


def test_price_takes_every_schedule_shardzoo_pipeline_runs():
    runs = {s: price("gpt2", 4, 16, 128, "dp=1,pp=2,tp=2", micro_batches=8, hardware="a100", schedule=s,
                     virtual_stages=v)
            for s, v in [("1f1b", 1), ("interleaved_1f1b", 3), ("zero_bubble", 3), ("zbv", 2), ("dualpipev", 2)]}
    step = {s: r.step_seconds for s, r in runs.items()}
    assert step["zero_bubble"] < step["interleaved_1f1b"] < step["1f1b"] and step["zbv"] < step["1f1b"]
    peak = {s: r.candidate.peak_bytes_per_rank for s, r in runs.items()}
    assert peak["1f1b"] <= peak["zbv"] and peak["1f1b"] < peak["interleaved_1f1b"] < peak["zero_bubble"]
    assert runs["interleaved_1f1b"].schedule == "interleaved"


@pytest.mark.parametrize("schedule,v,fix", [("zbv", 3, "virtual_stages=2"), ("zero_bubble", 1, "virtual_stages >= 2"),
                                            ("1f1b", 2, "virtual_stages=1"), ("chimera", 1, "is not one of")])
def test_a_schedule_with_the_wrong_chunk_count_is_refused_by_name(schedule, v, fix):
    with pytest.raises(ValueError, match=fix):
        schedule_name(schedule, v)
