"""A model ``parallelize`` splits, read for pricing: its plan, its attention modules, its
repeated block, and the order its modules run in.

Any ``nn.Module`` that ``shardzoo.parallelize(model, mesh, plan)`` accepts (a transformers
causal LM with its default plan, or a module of one's own with its plan) is walked once,
independent of the layout: the plan is matched to the modules as parallelize matches it, the
attention modules and their head counts are found by parallelize's own ``attention_modules``,
the blocks are those activation checkpointing finds (``checkpointing.block_names``), and one
forward on a tiny batch (on the meta device when the model is there: nothing is computed)
records the order the modules run in. walk_pieces.py then prices what was recorded for each
layout, and ``walked.ModelShape`` hands the planner those pieces. shardzoo's own families are
walked the same way, from their plain modules and plan (``walked.family_shape``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace

import torch
from torch import nn

from shardzoo.parallel import heads as head_counts
from shardzoo.parallel import hf_model
from shardzoo.parallel.activation_checkpointing import block_names
from shardzoo.parallel.dropouts import is_dropout
from shardzoo.parallel.kinds import is_weighted_kind
from shardzoo.parallel.parallelize import state_of
from shardzoo.parallel.styles import STYLES, check_plan, covered_prefixes, match_plan

# the traced batch: two rows of three tokens, so an input's leading dim tells a batch of rows
# (2) from one row broadcast over the batch (1, e.g. positions)
TRACE_BATCH, TRACE_SEQ = 2, 3


@dataclass
class Step:
    """One module run by the traced forward: its name, the plan's style for it (None: not
    planned), the last dim of its input, the input's leading dim, and whether it reads the very
    tensor its sibling before it read (q, k and v of one input; gate and up)."""

    name: str
    module: nn.Module
    style: str | None
    width: int | None
    lead: int | None
    shares_input: bool = False
    dims: int = 0  # of the input: 2 for one vector per row ([b, H]), 3 for tokens ([b, s, H])
    top_k: int | None = None  # an experts module's: the experts each token is routed to (top_k_index [T, K])


@dataclass
class Walk:
    """What the planner needs of a model and its plan, for every layout."""

    model: nn.Module
    plan: dict[str, str]
    planned: dict[str, tuple[nn.Module, str, str]]  # name -> (module, style, pattern), as parallelize
    attention: dict[str, head_counts.AttentionHeads]  # attention module name -> its counts (one head part)
    blocks: list[str]
    pre: list[Step]  # before the first block: the embeddings
    block: list[Step]  # the first block, priced once and repeated
    post: list[Step]  # after the last block: final norm, head
    held: dict[str, list[tuple[str, nn.Module]]] = field(default_factory=dict)  # unplanned modules holding weights
    dropouts: list[str] = field(default_factory=list)  # unplanned dropout modules with p > 0
    causal: bool = True
    transformers: bool = False
    given_plan: bool = False  # a plan passed in, rather than the model's default
    rope: bool = False
    idle: dict[str, list[Step]] = field(default_factory=dict)  # planned modules the forward did not run, by part

    @cached_property
    def off_chunks(self) -> list[str]:
        """Planned modules inside a block, holding weights, whose style cannot run on a Megatron
        sequence chunk (the same for every layout: read once)."""
        return [n for n, (m, st, _) in self.planned.items() if any(inside(n, b) for b in self.blocks)
                and not STYLES[st].on_sequence_chunks and next(m.parameters(), None) is not None]

    @cached_property
    def beside_experts(self) -> list[str]:
        """Planned layers directly in a MoE block (the parent of an experts module) other than
        its router and experts: the block reads its tokens flattened, so under Megatron
        sequence parallelism such a layer would read the flat chunk and parallelize refuses it
        (parallel/megatron_sp.py). A module of its own there (a shared expert's column / row
        pair) gets the chunk as [b, s/tp, H] and is priced as any MLP."""
        parents = {n.rpartition(".")[0] for n, _ in self.experts}
        return [n for n, (_, st, _) in self.planned.items()
                if n.rpartition(".")[0] in parents and getattr(STYLES[st], "put_on_chunks", None) is None]

    @cached_property
    def experts(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every module planned 'experts'."""
        return [(n, m) for n, (m, st, _) in self.planned.items() if st == "experts"]


class _OnePart:
    """What ``heads.attention_modules`` reads of a layout, for one keeping every head in one
    part: it then finds the attention modules and their counts only; each layout's split of them
    is checked by the planner (walk_pieces.check_walk)."""

    mode = "1d"
    activation = None
    mesh = SimpleNamespace(size=lambda axis: 1, tp_size=1)

    @staticmethod
    def linear_output(layout):
        return SimpleNamespace(hidden_axis="tp")


HEAD_STYLES = ("lm_head", "classifier")  # the head whose loss the planner prices


def walk_model(model: nn.Module, plan: dict[str, str] | None = None, *, example=None,
               causal: bool | None = None, partial: bool = False) -> Walk:
    """Read ``model`` (any module ``parallelize`` takes, best built on the meta device) and its
    ``plan`` (None: the model's default plan, as parallelize takes it) for pricing.
    ``example``: the first input of the traced forward (default: token ids [2, 3]); ``causal``:
    whether attention is causal (default: the model's ``is_causal``, or a transformers
    causal LM's); ``partial``: plan entries may match no module."""
    if state_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is parallelized already; the planner prices the serial model: "
                         f"pass it before shardzoo.parallelize (built on the meta device, it holds no weights)")
    given = plan is not None
    if plan is None:
        plan = hf_model.default_plan(model)
        if plan is None:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel plan of its own; pass its plan "
                             f"({{'<module pattern>': 'column' | 'row' | 'norm' | ...}}, docs/parallelize.md)")
    plan = check_plan(plan)
    planned = match_plan(model, plan, partial)  # as parallelize matches and checks it
    attention = head_counts.attention_modules(model, planned, _OnePart(), hf_model.config_heads(model))
    blocks = block_names(model)
    kinds = {type(model.get_submodule(b)).__name__ for b in blocks}
    sizes = {sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks}
    if len(kinds) > 1 or len(sizes) > 1:
        raise ValueError(f"{type(model).__name__} has blocks of {len(kinds)} classes ({sorted(kinds)}) and "
                         f"{len(sizes)} parameter counts; the planner prices one repeated block, so it needs "
                         f"blocks of one class and size")
    hf = hf_model.is_transformers_model(model)
    flag = getattr(model, "is_causal", None)
    if causal is None:
        causal = hf_model.is_causal_lm(model) if hf else (flag if isinstance(flag, bool) else True)
    pre, block, post = _trace(model, planned, blocks, hf, example)
    walk = Walk(model, plan, planned, attention, blocks, pre, block, post, causal=causal, transformers=hf,
                given_plan=given, rope=any("rotary" in type(m).__name__.lower() for m in model.modules()))
    _unplanned(walk)
    _idle(walk)
    if not any(s.style in HEAD_STYLES for s in post):
        raise ValueError(f"{type(model).__name__}: no module planned 'lm_head' (or 'classifier') runs after the "
                         f"blocks; the planner prices a training step ending in the head's loss")
    return walk


def inside(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def _trace(model: nn.Module, planned: dict, blocks: list[str], hf: bool,
           example=None) -> tuple[list[Step], list[Step], list[Step]]:
    """(steps before the blocks, steps of the first block, steps after them) of one forward:
    every planned module and every leaf module, in the order they run."""
    covered = covered_prefixes(planned)
    events: list[tuple[str, nn.Module, object]] = []
    handles = []
    for name, module in model.named_modules():
        if not name or name.startswith(covered) or (name not in planned and next(module.children(), None) is not None):
            continue

        def hook(mod, args, kwargs, name=name):
            x = args[0] if args else next(iter(kwargs.values()), None)
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            events.append((name, mod, x, index))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.zeros(TRACE_BATCH, TRACE_SEQ, dtype=torch.long, device=device)
    x = ids if example is None else example.to(device)
    skipped = _skip_later_blocks(model, blocks, handles) + _skip_experts(planned)
    try:
        with torch.no_grad():
            model(input_ids=ids) if hf else model(x)
    except Exception as err:
        raise ValueError(f"{type(model).__name__}: the planner runs one forward on an input of shape "
                         f"{list(x.shape)} to see the order its modules run in, and it failed "
                         f"({type(err).__name__}: {err}); the planner prices models whose forward takes that input") from err
    finally:
        for h in handles:
            h.remove()
        for block in skipped:
            del block.forward
    in_block = [i for i, (n, *_) in enumerate(events) if any(inside(n, b) for b in blocks)]
    if not in_block:
        raise ValueError(f"{type(model).__name__}: none of its blocks ({blocks[0]}, ...) ran in the traced forward")
    first, last = in_block[0], in_block[-1]
    steps = _steps(events, planned)
    pre, post = steps[:first], steps[last + 1:]
    block = [s for s in steps[first:last + 1] if inside(s.name, blocks[0])]
    return pre, block, post


def _skip_later_blocks(model: nn.Module, blocks: list[str], handles: list) -> list[nn.Module]:
    """Let the blocks after the first return the first block's output without running (they
    are of its class, so its output has the structure the model expects): the trace needs
    one block, and a deep model's forward, even on the meta device, costs seconds. Returns the
    blocks whose ``forward`` was replaced on the instance (the caller deletes it again)."""
    first = model.get_submodule(blocks[0])
    output: list = []
    handles.append(first.register_forward_hook(lambda mod, args, out: output.append(out)))
    skipped = []
    for name in blocks[1:]:
        block = model.get_submodule(name)
        if "forward" in block.__dict__:  # a forward of the instance's own: leave it running
            continue
        block.forward = lambda *args, **kwargs: output[-1]
        skipped.append(block)
    return skipped


def _skip_experts(planned: dict) -> list[nn.Module]:
    """Let the planned experts modules return their input without running: their pricer reads
    their weights and the routing's shape (top_k_index [T, K]), and their own forward (a grouped
    matmul, or a loop over the experts picking tokens by value) cannot run on the meta device.
    Returns the modules whose ``forward`` was replaced on the instance."""
    skipped = []
    for module, style, _ in planned.values():
        if style == "experts" and "forward" not in module.__dict__:
            module.forward = lambda hidden, *args, **kwargs: hidden
            skipped.append(module)
    return skipped


def _steps(events, planned: dict) -> list[Step]:
    last_input: dict[str, object] = {}  # parent name -> the input its previous column layer read
    out = []
    for name, module, x, index in events:
        tensor = torch.is_tensor(x)
        parent = name.rpartition(".")[0]
        style = planned[name][1] if name in planned else None
        shares = False
        if style in ("column", "packed_column"):
            shares = tensor and last_input.get(parent) is x
            last_input[parent] = x
        top_k = index.shape[-1] if style == "experts" and torch.is_tensor(index) and index.dim() else None
        out.append(Step(name, module, style, x.shape[-1] if tensor and x.dim() else None,
                        x.shape[0] if tensor and x.dim() else None, bool(shares), x.dim() if tensor else 0, top_k))
    return out


def _unplanned(walk: Walk) -> None:
    """Record the modules the plan leaves alone that hold weights (kept whole on every rank in
    1d, refused by the grid layouts) and the dropout modules with p > 0 (refused under tp > 1),
    each under the part of the model it belongs to: 'pre', 'block' or 'post'. A Linear,
    Conv1D, Embedding or norm left out is refused in every layout, as parallelize refuses it."""
    covered = covered_prefixes(walk.planned)
    pre_names = {s.name for s in walk.pre}
    for name, module in walk.model.named_modules():
        if not name or name in walk.planned or name.startswith(covered):
            continue
        if is_dropout(module) and getattr(module, "p", 0.0) > 0:
            walk.dropouts.append(name)
        if is_weighted_kind(module):
            raise ValueError(f"{name} ({type(module).__name__}) is not in the plan, and the layouts split the "
                             f"activations it reads; add it to the plan: plan[{name!r}] = 'column' / 'row' / 'norm' / "
                             f"'embedding' ..., or 'replicate' to keep it whole on every rank")
        if next(module.parameters(recurse=False), None) is None:
            continue
        if any(inside(name, b) for b in walk.blocks):
            if inside(name, walk.blocks[0]):
                walk.held.setdefault("block", []).append((name, module))
            continue
        walk.held.setdefault("pre" if name in pre_names else "post", []).append((name, module))


def _idle(walk: Walk) -> None:
    """Record the planned modules holding weights that the traced forward did not run (a
    pooler the training loss does not use): their parameters are held all the same. Each is
    put in the part of the model it is registered in."""
    ran = {s.name for s in walk.pre + walk.block + walk.post}
    names = [n for n, _ in walk.model.named_modules()]
    first_block = names.index(walk.blocks[0])
    for name, (module, style, _) in walk.planned.items():
        if name in ran or STYLES[style].keeps_children or next(module.parameters(), None) is None:
            continue
        if any(inside(name, b) for b in walk.blocks):
            continue  # every block runs in the forward
        part = "pre" if names.index(name) < first_block else "post"
        walk.idle.setdefault(part, []).append(Step(name, module, style, None, None))
