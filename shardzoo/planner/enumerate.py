"""Every legal candidate of a world: dp x pp x sp x tp, each tp_mode (2.5D at every depth >= 2),
micro-batch counts, ep (a MoE model), the pipeline schedule, activation checkpointing on / off
and ZeRO stages, with the reason each pruned choice fails (``--explain``).

Choices are made outermost first (tp and its mode, then sp, pp, dp, micro-batches), and a rule
is checked as soon as the choice it depends on is made, so one failed rule prunes everything
below it: a tp that does not divide the heads is never combined with any sp, pp or dp.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterator

from shardzoo.comm.mesh import default_tp_depth, tp_grid_text, tp_sub_shape
from shardzoo.comm.tp_grids import TP_GRIDS, TP_MODES
from shardzoo.planner.block_costs import Illegal, costs_of
from shardzoo.planner.evaluate import Candidate
from shardzoo.planner.model import Batch
from shardzoo.planner.schedules import chunk_rule
from shardzoo.planner.walked import ModelShape

ZERO_STAGES = (0, 1, 2, 3)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_grids(world: int, modes=TP_MODES) -> Iterator[tuple[str, int, int]]:
    """(tp_mode, tp, tp_depth) of every distinct tp grid whose size divides ``world``
    (``TpGrid.planned_depths``: 1d any size, the grids with side q >= 2, 2.5d at depth >= 2).
    Per tp: 1d first, then the grids by side, equal sides in TP_MODES order."""
    for tp in divisors(world):
        found = [(mode, tp, depth) for mode, grid in TP_GRIDS.items() if mode in modes
                 for depth in grid.planned_depths(tp)]
        yield from sorted(found, key=lambda g: (_side(*g), TP_MODES.index(g[0])))


def _side(mode: str, tp: int, depth: int) -> int:
    """The grid side q the enumeration orders by; 0 for 1d, which comes first."""
    grid = TP_GRIDS[mode]
    return 0 if grid.sides == 1 else grid.side(tp, depth)


@dataclass(frozen=True)
class Pruned:
    """A choice the enumeration dropped, and the rule it breaks."""

    what: str
    reason: str


@dataclass(frozen=True)
class Problem:
    """What is planned: the model, the world and the global batch of ``seq`` tokens each."""

    shape: ModelShape
    world: int
    global_batch: int
    seq: int
    sp_mode: str = "ring"
    e: int = 4
    param_bytes: int = 4
    mask_bytes: int = 1  # per dropout-mask element: 1 on CUDA (bool), e on CPU
    attention: str = "flash"  # the attention kernel priced (comm.ATTENTION_KERNELS)
    sequence_parallel: bool = True  # Megatron sequence parallelism in 1d, as parallelize and the families build

    def chunks(self, mode: str, tp: int, pp: int = 1) -> int:
        """The sequence chunks between the blocks' tp layers: tp in 1d with tp > 1 when the model
        is built whole or cut by ``parallelize`` (a family's pipeline stage keeps its activations
        replicated, models/planned.py)."""
        inside = pp == 1 or self.shape.sequence_parallel_stages
        return tp if self.sequence_parallel and mode == "1d" and tp > 1 and inside else 1


def _grid_rule(problem: Problem, mode: str, tp: int, depth: int, sp: int) -> str | None:
    """Why the model cannot be built on this tp grid with this sp at all (or None)."""
    costs = costs_of(mode, tp, depth, problem.param_bytes)
    parts = costs.batch_parts(costs.canonical)
    probe = Batch(parts, problem.seq, sp, problem.sp_mode, problem.e, True, problem.mask_bytes, problem.attention,
                  problem.chunks(mode, tp))
    try:
        problem.shape.check(costs, probe)
        problem.shape.parts(costs, probe)
    except Illegal as err:
        return str(err)
    return None


def micro_batch_counts(rows: int, pp: int, parts: int) -> list[int]:
    """Micro-batch counts m of a replica's ``rows``: m divides rows, rows / m divides by the
    layout's batch parts, and m >= pp (torch's 1F1B / GPipe need a micro-batch per stage);
    pp = 1 runs the replica's batch as one."""
    if pp == 1:
        return [1] if rows % parts == 0 else []
    return [m for m in divisors(rows) if m >= pp and (rows // m) % parts == 0]


def expert_splits(shape, dp: int, sp: int) -> list[int]:
    """The ep of a MoE model on dp x sp ranks: the divisors of dp x sp that divide its expert
    count (ParallelMesh's and the experts style's rules); [1] for a model without experts."""
    n = shape.n_experts
    return [e for e in divisors(dp * sp) if n % e == 0] if n else [1]


def candidates(problem: Problem, modes=TP_MODES, pruned: list[Pruned] | None = None,
               schedules=(("1f1b", 1),)) -> Iterator[Candidate]:
    """Every legal (dp, pp, sp, tp, tp_mode, tp_depth, micro_batches, ep, schedule); dropped
    choices go to ``pruned`` with their reason when a list is given. ``schedules``: the
    (schedule, virtual_stages) pairs tried where pp > 1 (schedules.ENUMERATED: all of them)."""
    shape, world = problem.shape, problem.world

    def drop(what, reason):
        if pruned is not None:
            pruned.append(Pruned(what, reason))

    for mode, tp, depth in tp_grids(world, modes):
        grid = tp_grid_text(tp, mode, depth)
        costs = costs_of(mode, tp, depth, problem.param_bytes)
        parts = costs.batch_parts(costs.canonical)
        for sp in divisors(world // tp):
            reason = _grid_rule(problem, mode, tp, depth, sp)
            if reason:
                drop(f"sp={sp},{grid}", reason)
                continue
            for pp in divisors(world // (tp * sp)):
                dp = world // (tp * sp * pp)
                what = f"dp={dp},pp={pp},sp={sp},{grid}"
                if pp > 1 and not shape.pipelines:
                    drop(what, f"pp={pp}: the model has no pipeline plan naming one nn.ModuleList of blocks, so "
                               f"parallelize cannot cut it into stages; it runs with pp=1")
                    continue
                if pp > shape.layers:
                    drop(what, f"pp={pp} exceeds the model's {shape.layers} blocks (every stage needs one)")
                    continue
                if problem.global_batch % dp:
                    drop(what, f"the global batch {problem.global_batch} is not divisible by dp={dp}")
                    continue
                rows = problem.global_batch // dp
                counts = micro_batch_counts(rows, pp, parts)
                if not counts:
                    need = f" and at least pp={pp} micro-batches" if pp > 1 else ""
                    drop(what, f"the replica batch {rows} does not split into micro-batches divisible by the "
                               f"layout's {parts} batch parts{need}")
                    continue
                splits = expert_splits(shape, dp, sp)
                for m in counts:
                    for ep in splits:
                        for schedule, v in (schedules if pp > 1 else (("1f1b", 1),)):
                            if chunk_rule(schedule, v, pp, m, shape.layers):  # tried where it applies
                                continue
                            yield Candidate(dp, pp, sp, tp, mode, depth, m, v, ep, schedule)


_CANDIDATE_KEYS = ("dp", "pp", "sp", "tp", "tp_mode", "tp_depth", "micro_batches", "ep")


def parse_candidate(text: str) -> dict:
    """``"dp=2,pp=1,sp=1,tp=4,tp_mode=2d"`` (any of the ParallelMesh kwargs and micro_batches;
    missing sizes are 1, tp_mode 1d) -> a dict."""
    out: dict = {}
    for part in filter(None, re.split(r"[,\s]+", text.strip())):
        key, _, value = part.partition("=")
        if key not in _CANDIDATE_KEYS or not value:
            raise ValueError(f"--explain {text!r}: {part!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(_CANDIDATE_KEYS)}; e.g. --explain dp=2,pp=1,sp=1,tp=4,tp_mode=2d")
        if key == "tp_mode":
            if value not in TP_MODES:
                raise ValueError(f"--explain: tp_mode={value!r} is not one of {', '.join(TP_MODES)}")
            out[key] = value
        elif not value.isdigit() or int(value) < 1:
            raise ValueError(f"--explain: {key}={value!r} must be a positive integer")
        else:
            out[key] = int(value)
    return out


_SIZE_KEYS = ("dp", "pp", "sp", "tp")


def _request_rules(problem: Problem, want: dict, text: str) -> list[Pruned]:
    """Rules the requested candidate breaks by itself, before any model rule: a tp its mode cannot
    lay out as a grid, sizes whose product is not (or cannot be made) the world size."""
    out = []
    mode = want.get("tp_mode", "1d")
    if "tp" in want:
        try:
            tp_sub_shape(want["tp"], mode, want.get("tp_depth", default_tp_depth(want["tp"], mode)))
        except ValueError as err:
            out.append(Pruned(text, str(err)))
    given = {k: want[k] for k in _SIZE_KEYS if k in want}
    product = math.prod(given.values())
    formula = "*".join(given) + f" = {product}"
    if len(given) == len(_SIZE_KEYS) and product != problem.world:
        out.append(Pruned(text, f"{formula} is not the world size {problem.world}"))
    elif given and problem.world % product:
        out.append(Pruned(text, f"{formula} does not divide the world size {problem.world}, so no other sizes make "
                                f"the product {problem.world}"))
    return out


def explain(problem: Problem, text: str) -> tuple[list[Candidate], list[Pruned]]:
    """The legal layouts matching ``text`` and the reasons they are not legal: rules the request
    breaks by itself, then the dropped choices that could have produced it."""
    want = parse_candidate(text)
    pruned: list[Pruned] = []
    mode = want.get("tp_mode", "1d")
    found = [candidate for candidate in candidates(problem, (mode,), pruned)
             if all(getattr(candidate, k) == v for k, v in want.items())]

    def matches(p: Pruned) -> bool:
        """The dropped choice agrees with every size given, and the sizes it fixes leave room for
        the requested ones (a choice of tp=8 on 8 devices cannot give dp=8)."""
        items = dict(kv.split("=") for kv in p.what.split(","))
        if any(str(want[k]) != items[k] for k in want if k in items):
            return False
        fixed = math.prod(int(items[k]) for k in _SIZE_KEYS if k in items)
        fixed *= math.prod(want[k] for k in _SIZE_KEYS if k in want and k not in items)
        return problem.world % fixed == 0

    return found, _request_rules(problem, want, text) + [p for p in pruned if matches(p)]
