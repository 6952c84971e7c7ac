"""Cutting a model into pipeline stages: which blocks each stage holds, and the placeholders
that stand where this rank holds nothing.

The cut follows the model's pipeline plan, transformers' ``base_model_pp_plan`` (its keys in
forward order: the modules before the repeated blocks, the blocks, the modules after), plus the
head class's ``_pp_plan`` (``lm_head``); GPT-2, which has none, gets one shipped here, and a
module of one's own gives ``pp_plan`` (argument or attribute) of the same form. Modules the
plan does not name (rotary embeddings) stay on every stage.

The blocks are cut into ``pp * virtual_stages`` contiguous stages, evenly (the first stages
take the remainder) or by ``stages=[n0, n1, ...]``. Stage ``s`` runs on pp rank ``s % pp``
("loop" placement, the interleaved schedules) or, with ``placement="v"`` and two virtual
stages, on ranks ``0, 1, ..., pp-1, pp-1, ..., 0`` (the V of the zbv / DualPipeV schedules).

What this rank does not hold is replaced, before any weight is allocated or split, by a
:class:`Placeholder`: an identity on the block's hidden states (transformers' own approach,
which keeps every block's index, so per-layer config entries still line up); a module before
the blocks that holds weights other than the token table (GPT-2's learned positions, added to
the input embeddings) becomes a :class:`ZeroPlaceholder`, since a later stage's input already
contains it; the token embedding of a model of one's own becomes a :class:`Received`, which
returns the stage's input (transformers models take it as ``inputs_embeds``). A rank holding several stages runs one at a time: the block list shows the active
stage's blocks only (:class:`StageBlocks`) and the modules before / after the blocks act as
placeholders outside the first / last stage (:class:`StageGate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardzoo.layers.shard_spec import set_tied_copies

CUT = "_shardzoo_stages"
PLACEMENTS = ("loop", "v")

# pipeline plans for transformers base models that have none (matched by class name)
SHIPPED_PP_PLANS = {
    "GPT2Model": {"wte": (["input_ids"], ["inputs_embeds"]), "wpe": (["position_ids"], ["position_embeds"]),
                  "drop": (["hidden_states"], ["hidden_states"]), "h": (["hidden_states"], ["hidden_states"]),
                  "ln_f": (["hidden_states"], ["hidden_states"])},
}


class Placeholder(nn.Module):
    """Stands for a module another stage holds: returns its first input unchanged."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))

    def extra_repr(self) -> str:
        return "held by another pipeline stage"


class Received(Placeholder):
    """Stands for the token embedding of a model of one's own on a stage that does not hold it:
    returns the activation the stage received from the previous one."""

    def __init__(self, cut: "StageCut"):
        super().__init__()
        self.__dict__["cut"] = cut  # not a submodule

    def forward(self, *args, **kwargs):
        return self.__dict__["cut"].incoming


class ZeroPlaceholder(Placeholder):
    """Stands for an embedding added to the inputs on the first stage: adds nothing later."""

    def forward(self, *args, **kwargs):
        return torch.zeros(())


@dataclass
class StageCut:
    """How a model is cut: block counts per stage, which stages this rank holds, the names of
    the blocks list and of the modules before / after it, and the stage a rank runs now."""

    counts: list[int]
    pp: int
    placement: str
    held: list[int]
    blocks: str  # qualified name of the nn.ModuleList of blocks
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    embedding: str | None = None  # the input token table (skipped, not replaced, on later stages)
    tied: bool = False
    head: str | None = None  # the output embedding (an untied copy of the table on a last stage)
    active: int | None = None  # the stage whose forward runs now (several held), else None
    # a model of one's own takes a later stage's input where its token embedding's output was
    # (transformers models take it as inputs_embeds): the activation received, while a stage runs
    through_embedding: bool = False
    incoming: torch.Tensor | None = None
    # Megatron sequence parallelism (megatron_sp.py): the stages send this tp rank's sequence
    # chunk. While a stage runs (pipelined.py), ``chunk_in`` is the chunk it received (its first
    # block takes it in place of the stand-in the model's code ran on), and with ``sending`` its
    # last block leaves its chunk in ``chunk_out`` (the stage's output, not what the model returns)
    chunked: bool = False
    chunk_in: torch.Tensor | None = None
    sending: bool = False
    chunk_out: torch.Tensor | None = None

    @property
    def n_stages(self) -> int:
        return len(self.counts)

    def bounds(self, stage: int) -> range:
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def rank_of(self, stage: int) -> int:
        if self.placement == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stage_of_block(self, index: int) -> int:
        return next(s for s in range(self.n_stages) if index in self.bounds(s))

    @property
    def holds_first(self) -> bool:
        return 0 in self.held

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.held

    def runs(self, stage: int | None = None) -> bool:
        """Whether the module doing the work of ``stage`` ("first" / "last" / a block's) runs now."""
        return self.active is None or stage == self.active


def cut_of(model: nn.Module) -> StageCut | None:
    """The :class:`StageCut` of a model cut into pipeline stages, else None."""
    return model.__dict__.get(CUT)


def pp_plan_of(model: nn.Module, pp_plan: dict | None = None, hf: bool = False) -> tuple[str, list[str], list[str]]:
    """(prefix of the base model, its plan's keys in order, the head's top-level keys);
    ``hf``: a transformers model."""
    if pp_plan is not None or not hf:
        plan = pp_plan if pp_plan is not None else getattr(model, "pp_plan", None)
        if not plan:
            raise ValueError(f"{type(model).__name__} has no pipeline plan; pass parallelize(..., pp_plan={{'embed': "
                             f"(['input_ids'], ['inputs_embeds']), 'layers': (['hidden_states'], ['hidden_states']), "
                             f"'norm': ...}}) naming its modules in forward order, the blocks an nn.ModuleList")
        return "", list(plan), []
    base = model.base_model
    prefix = model.base_model_prefix if base is not model else ""
    plan = getattr(model.config, "base_model_pp_plan", None) or SHIPPED_PP_PLANS.get(type(base).__name__)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no pipeline plan (config.base_model_pp_plan) and shardzoo ships "
                         f"none for {type(base).__name__}; set config.base_model_pp_plan naming its modules in forward "
                         f"order (e.g. {{'embed_tokens': ..., 'layers': ..., 'norm': ...}})")
    head = list(getattr(type(model), "_pp_plan", None) or ({"lm_head": None} if hasattr(model, "lm_head") else {}))
    return prefix, list(plan), [k for k in head if base is not model]


def plan_parts(model: nn.Module, pp_plan: dict | None = None, hf: bool = False) -> tuple[list[str], str, list[str]]:
    """(the modules before the blocks, the blocks' nn.ModuleList, the modules after them), as
    qualified names, from the model's pipeline plan; raises naming what the plan lacks."""
    prefix, keys, head = pp_plan_of(model, pp_plan, hf)
    join = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: k)
    modules = dict(model.named_modules())
    missing = [join(k) for k in keys + head if join(k) not in modules and k not in modules]
    if missing:
        raise ValueError(f"the pipeline plan names {missing}, which {type(model).__name__} does not have")
    lists = [k for k in keys if isinstance(modules[join(k)], nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{type(model).__name__}'s pipeline plan {keys} must name exactly one nn.ModuleList of "
                         f"repeated blocks to cut into stages; it names {len(lists)} ({lists})")
    at = keys.index(lists[0])
    return [join(k) for k in keys[:at]], join(lists[0]), [join(k) for k in keys[at + 1:]] + head


def split_counts(n_blocks: int, n_stages: int, stages) -> list[int]:
    """Blocks per stage: ``stages`` checked, or an even split with the remainder on the first."""
    if stages is None:
        if n_blocks < n_stages:
            raise ValueError(f"the model has {n_blocks} blocks, fewer than its {n_stages} pipeline stages "
                             f"(pp x virtual_stages); every stage needs at least one block: lower pp or virtual_stages")
        per, extra = divmod(n_blocks, n_stages)
        return [per + (s < extra) for s in range(n_stages)]
    counts = list(stages)
    if len(counts) != n_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts) \
            or sum(counts) != n_blocks:
        raise ValueError(f"stages={counts} must give the block count of each of the {n_stages} pipeline stages "
                         f"(pp x virtual_stages), each >= 1, summing to the model's {n_blocks} blocks")
    return counts


def held_stages(pp: int, pp_rank: int, n_stages: int, placement: str) -> list[int]:
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))


def cut(model: nn.Module, mesh, *, stages=None, virtual_stages: int = 1, placement: str = "loop",
        pp_plan: dict | None = None, hf: bool = False) -> StageCut:
    """Keep this rank's stage(s) of ``model`` and put placeholders where it holds nothing, in
    place (module doc); everything is checked before anything changes. Returns the cut."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} must be an int >= 1 (stages per pp rank)")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"placement='v' puts two stages on each rank (0..pp-1, then back); got virtual_stages="
                         f"{virtual_stages}: pass virtual_stages=2")
    before, blocks, after = plan_parts(model, pp_plan, hf)
    modules = dict(model.named_modules())
    n_stages = mesh.pp_size * virtual_stages
    counts = split_counts(len(modules[blocks]), n_stages, stages)
    held = held_stages(mesh.pp_size, mesh.pp_rank, n_stages, placement)
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = {id(m): n for n, m in modules.items()}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = inp is not None and out is not None and getattr(inp, "weight", None) is getattr(out, "weight", 0)
    embedding = names.get(id(inp)) if hf else _token_module(model, pp_plan, before)
    result = StageCut(counts, mesh.pp_size, placement, held, blocks, before, after, embedding, tied,
                      names.get(id(out)), through_embedding=not hf)
    _replace(model, result)
    model.__dict__[CUT] = result
    if tied and result.holds_last and not result.holds_first and result.head and result.embedding:
        set_tied_copies(model, {f"{result.head}.weight": f"{result.embedding}.weight"})
    return result


def _token_module(model: nn.Module, pp_plan: dict | None, before: list[str]) -> str | None:
    """The module of a plan of one's own that reads the token ids (its inputs name
    ``input_ids``), else the first module before the blocks."""
    plan = pp_plan if pp_plan is not None else getattr(model, "pp_plan", None) or {}
    for name in before:
        entry = plan.get(name)
        if entry and "input_ids" in entry[0]:
            return name
    return before[0] if before else None


def _replace(model: nn.Module, result: StageCut) -> None:
    blocks = model.get_submodule(result.blocks)
    keep = {i for s in result.held for i in result.bounds(s)}
    for i in range(len(blocks)):
        if i not in keep:
            blocks[i] = Placeholder()
    if not result.holds_first:
        for name in result.before:
            module = model.get_submodule(name)
            weights = name != result.embedding and next(module.parameters(), None) is not None
            received = name == result.embedding and result.through_embedding
            model.set_submodule(name, Received(result) if received else ZeroPlaceholder() if weights else Placeholder())
    if not result.holds_last:
        for name in result.after:
            model.set_submodule(name, Placeholder())
    if len(result.held) > 1:
        blocks.__class__ = StageBlocks
        blocks.__dict__["_stage_cut"] = result


def gate_ends(model: nn.Module) -> None:
    """On a rank holding several stages, make the modules before / after the blocks act as
    placeholders while a stage other than the first / last runs (:class:`StageGate`); called
    once the plan's layers are in place (they replace the modules the cut saw)."""
    result = cut_of(model)
    if result is None or len(result.held) == 1:
        return
    for name in result.before if result.holds_first else ():
        module = model.get_submodule(name)
        if name != result.embedding:
            _gate(module, result, 0, zero=next(module.parameters(), None) is not None)
        elif result.through_embedding:
            _gate(module, result, 0, zero=False, received=True)
    for name in result.after if result.holds_last else ():
        _gate(model.get_submodule(name), result, result.n_stages - 1, zero=False)


class StageBlocks(nn.ModuleList):
    """The blocks list of a rank holding several stages: iterating or indexing it gives the
    active stage's blocks and placeholders elsewhere (module doc); its registered modules (names,
    parameters, state dict) are every block this rank holds."""

    def _visible(self) -> list[nn.Module]:
        cut = self.__dict__["_stage_cut"]
        modules = list(self._modules.values())
        if cut.active is None:
            return modules
        mine = cut.bounds(cut.active)
        return [m if i in mine else _IDENTITY for i, m in enumerate(modules)]

    def __iter__(self):
        return iter(self._visible())

    def __getitem__(self, idx):  # an index or a slice (``self.layers[: n]``): a list, as iterated
        return self._visible()[idx]


_IDENTITY = Placeholder()


class StageGate:
    """A held module's forward that acts as its placeholder while another of the rank's stages runs."""

    def __init__(self, module: nn.Module, cut: StageCut, stage: int, zero: bool, received: bool = False):
        self.forward, self.cut, self.stage, self.zero, self.received = module.forward, cut, stage, zero, received

    def __call__(self, *args, **kwargs):
        if self.cut.runs(self.stage):
            return self.forward(*args, **kwargs)
        if self.received:  # a token embedding of one's own: the stage's received activation
            return self.cut.incoming
        return torch.zeros(()) if self.zero else (args[0] if args else next(iter(kwargs.values())))


def _gate(module: nn.Module, cut: StageCut, stage: int, zero: bool, received: bool = False) -> None:
    module.forward = StageGate(module, cut, stage, zero, received)
