"""Megatron sequence parallelism between the 1D blocks of a split model (on by default in 1d).

With tp > 1 in 1d, the activations between the tp blocks are split along the sequence over
tp (layers/sequence_shards.py): the norms, dropout and residual adds of each block run on this
rank's chunk of the sequence; its column layers all-gather the chunks once per tensor they read
(q, k, v share one, gathered at the input of the attention module that holds them, whose code
then reads the whole sequence's shape) and its row layers reduce-scatter their sum back to chunks. The same bytes
travel as the all-reduce pair they replace; what each rank holds between blocks is 1/tp.

The blocks are the children of the model's lists of repeated blocks (activation_checkpointing.py finds
them by structure), so the layout covers what runs inside them. The first block of each list
enters it (its hidden-states input, replicated over tp, is cut into chunks: no communication
forward), the last one leaves it (the chunks are all-gathered), so the embeddings, the final
norm and the head see the replicated activation as without sequence parallelism, and whatever
the model does outside its blocks (position tables, poolers, ``logits_to_keep``) is unchanged.
A sequence length tp does not divide is padded with zero rows at the end, which every way out
of the layout drops first (exact). A model cut into pipeline stages (pipeline_cut.py) stays in
the layout across the stage boundaries, as Megatron's does: each stage's blocks are a list of
their own, the first stage enters and the last leaves, and the stages in between send and
take this rank's chunk (the model's code around their blocks runs on a stand-in of the whole
shape; pipelined.py).

Inside a block every planned module must be one that runs on a chunk: a column, row, norm
(its weight gradient, computed on this rank's tokens only, is summed over tp by backward) or
dropout (the chunk of the whole activation's mask), or a module holding no weights; a module
of another style holding weights there is refused by name. A MoE block flattens its chunk to
``[b * s/p, H]``: its router and experts run on that, and a module of its own beside them (a
shared expert) gets it back as ``[b, s/p, H]`` for its column / row pair (``_FlatTokens``).
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers.common_1d import SEQ_DIM
from shardzoo.layers.experts import is_experts
from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.norm_1d import LayerNorm1D, RMSNorm1D
from shardzoo.layers.rng_streams import ParallelDropout
from shardzoo.layers.sequence_shards import SequenceShards
from shardzoo.parallel import activation_checkpointing, pipeline_cut
from shardzoo.parallel.activation_checkpointing import shards_of  # noqa: F401  (its public home stays here too)
from shardzoo.parallel.styles import STYLES

_ATTR = activation_checkpointing.SHARDS


def applies(layout, enabled: bool) -> bool:
    """Whether a model split by ``layout`` gets sequence-sharded blocks: 1d with tp > 1, when enabled."""
    return bool(enabled) and layout.mode == "1d" and layout.mesh.tp_size > 1


def block_lists(model: nn.Module) -> list[list[str]]:
    """The model's lists of repeated blocks (activation_checkpointing.py), each as its blocks' names in order;
    [] when it has none."""
    try:
        names = activation_checkpointing.block_names(model)
    except ValueError:
        return []
    lists: dict[str, list[str]] = {}
    for name in names:
        lists.setdefault(name.rpartition(".")[0], []).append(name)
    cut = pipeline_cut.cut_of(model)
    if cut is None:
        return list(lists.values())
    runs: dict[tuple[str, int], list[str]] = {}  # a pipeline stage's blocks enter and leave on their own
    for parent, members in lists.items():
        for name in members:
            stage = cut.stage_of_block(int(name.rpartition(".")[2])) if parent == cut.blocks else -1
            runs.setdefault((parent, stage), []).append(name)
    return list(runs.values())


def check(model: nn.Module, planned: dict, layout, enabled: bool) -> None:
    """Refuse, before anything moves, a planned module inside a block that cannot run on a chunk."""
    if not applies(layout, enabled):
        return
    inside = tuple(f"{name}." for names in block_lists(model) for name in names)
    _check_moe_blocks(planned, inside, layout)
    covered = tuple(f"{n}." for n in planned)
    for name, module in model.named_modules():
        if name.startswith(inside) and name not in planned and not name.startswith(covered) \
                and next(module.parameters(recurse=False), None) is not None:
            raise ValueError(f"{name} ({type(module).__name__}) holds weights inside a block and is not in the plan; "
                             f"Megatron sequence parallelism (on by default in 1d, tp={layout.mesh.tp_size}) "
                             f"would run it on this rank's chunk of the sequence, its gradient covering those "
                             f"tokens only; plan it, or pass sequence_parallel=False")
    for name, (module, style, pattern) in planned.items():
        if not name.startswith(inside) or STYLES[style].on_sequence_chunks:
            continue
        if next(module.parameters(), None) is not None:
            raise ValueError(f"{name} ({type(module).__name__}) is planned {style!r} inside a block, where Megatron "
                             f"sequence parallelism (on by default in 1d, tp={layout.mesh.tp_size}) splits the "
                             f"activations along the sequence, so its weight gradient would cover this rank's "
                             f"tokens only; plan it 'column' / 'row' / 'norm', or pass sequence_parallel=False")


def _moe_blocks(planned: dict, inside: tuple[str, ...]) -> set[str]:
    """The MoE blocks (parents of a module with the experts contract) inside the model's blocks."""
    return {name.rpartition(".")[0] for name, (module, _, _) in planned.items()
            if name.startswith(inside) and is_experts(module)}


def _beside_experts(planned: dict, inside: tuple[str, ...]) -> dict[str, str]:
    """{planned name: its MoE block} of the planned modules in a MoE block other than its
    router and experts (styles whose layer runs on the block's flat chunk: ``put_on_chunks``)."""
    blocks = _moe_blocks(planned, inside)
    out = {}
    for name, (_, style, _) in planned.items():
        parent = next((b for b in blocks if name.startswith(f"{b}.")), None)
        if parent is not None and getattr(STYLES[style], "put_on_chunks", None) is None:
            out[name] = parent
    return out


def _check_moe_blocks(planned: dict, inside: tuple[str, ...], layout) -> None:
    """A MoE block (the parent of a module with the experts contract) reads its tokens
    flattened [T, H]: its router and experts run on this rank's chunk of them, and a module of
    its own beside them (a shared expert: a column / row pair) gets them as [b, s/p, H]
    (``_FlatTokens``); a layer planned directly in the block would read the flat chunk:
    refused by name."""
    for name, parent in _beside_experts(planned, inside).items():
        if name.rpartition(".")[0] != parent:
            continue
        module, style, _ = planned[name]
        raise ValueError(f"{name} ({type(module).__name__}, planned {style!r}) sits directly in the MoE block "
                         f"{parent}, which reads its tokens flattened; under Megatron sequence parallelism (on by "
                         f"default in 1d, tp={layout.mesh.tp_size}) the block's router and experts run on this rank's "
                         f"chunk of the tokens, and a {style!r} layer here would read that flat chunk. Plan a gate "
                         f"onto one output 'router' (whole, on the chunk), hold a dense MLP in a module of its own (as "
                         f"Qwen2-MoE's shared_expert), or pass sequence_parallel=False")


def install(model: nn.Module, planned: dict, layout, enabled: bool) -> SequenceShards | None:
    """Put the built modules inside ``model``'s blocks on sequence chunks and hook the first and
    last block of each list to enter and leave the layout (module doc); None when it does not
    apply (not 1d, tp = 1, disabled, or no lists of blocks)."""
    lists = block_lists(model)
    if not applies(layout, enabled) or not lists:
        return None
    shards = SequenceShards(layout.mesh)
    blocks = {name for names in lists for name in names}
    inside = tuple(f"{name}." for name in blocks)
    readers, partial = set(), {}
    for name, (_, style, _) in planned.items():
        if name.startswith(inside):
            module = model.get_submodule(name)
            put_on_chunks = getattr(STYLES[style], "put_on_chunks", None)
            if put_on_chunks is not None:  # a router or experts: its gradient summed over tp
                put_on_chunks(module, layout.mesh)
            block = next(b for b in blocks if name.startswith(f"{b}."))
            partial.setdefault(block, []).extend((module, p) for p in _on_chunks(module, shards))
            parent = name.rpartition(".")[0]
            if isinstance(module, ParallelLinear1D) and module.style == "column" and parent not in blocks:
                readers.add(parent)
    for block, members in partial.items():  # one all-reduce per block for the norms' and row biases' gradients
        shards.partial_grads.hook_block(model.get_submodule(block), members)
    for name in sorted(readers):  # gather where the attention / MLP code reads its input's shape
        model.get_submodule(name).register_forward_pre_hook(_Gather(shards), with_kwargs=True)
    inside = tuple(f"{name}." for name in blocks)
    beside = _beside_experts(planned, inside)
    mlps = {f"{block}.{name[len(block) + 1:].split('.')[0]}" for name, block in beside.items()}
    for name in sorted(mlps):  # a shared expert reads the MoE block's flat chunk (before its gather)
        hooks = _FlatTokens(shards)
        model.get_submodule(name).register_forward_pre_hook(hooks.before, with_kwargs=True, prepend=True)
        model.get_submodule(name).register_forward_hook(hooks.after)
    cut = pipeline_cut.cut_of(model)
    for names in lists:
        receives, sends = _stage_ends(cut, names)
        model.get_submodule(names[0]).register_forward_pre_hook(_Enter(shards, cut if receives else None),
                                                                with_kwargs=True)
        model.get_submodule(names[-1]).register_forward_hook(_Leave(shards, cut if sends else None))
    if cut is not None:
        cut.chunked = True
    base = getattr(model, "base_model", None)
    for module in {id(m): m for m in (base, model) if isinstance(m, nn.Module)}.values():  # inner first
        module.register_forward_hook(_JoinHiddenStates(shards))
    model.__dict__[_ATTR] = shards
    return shards


def _stage_ends(cut, names: list[str]) -> tuple[bool, bool]:
    """(whether this run of blocks receives its input from a pipeline stage before it, whether
    it sends its output to one after it): a run of the cut blocks of a stage other than the
    first / last."""
    parent, _, index = names[0].rpartition(".")
    if cut is None or parent != cut.blocks:
        return False, False
    stage = cut.stage_of_block(int(index))
    return stage > 0, stage < cut.n_stages - 1


def _on_chunks(module: nn.Module, shards: SequenceShards) -> list[str]:
    """Put a built module inside a block on sequence chunks; returns the names of its parameters
    whose gradients are then partial over tp (a norm's, a row layer's bias: layers/partial_grads.py)."""
    if isinstance(module, ParallelLinear1D):
        module.use_sequence_shards(shards)
        return ["bias"] if module.style == "row" and module.bias is not None else []
    if isinstance(module, (LayerNorm1D, RMSNorm1D)):
        module.sequence_parallel = True  # weight gradient summed over tp (norm_1d.py)
        module.partial_grads = shards.partial_grads
        return [p for p in ("weight", "bias") if getattr(module, p, None) is not None]
    if isinstance(module, ParallelDropout):
        module.sequence = shards
    return []


def _first_input(module: nn.Module, args: tuple, kwargs: dict, change):
    """(args, kwargs) with ``change`` applied to the first positional input or ``hidden_states=``."""
    if args:
        return (change(args[0]), *args[1:]), kwargs
    if "hidden_states" not in kwargs:
        raise ValueError(f"{type(module).__name__} was called without a positional input or hidden_states=; "
                         f"Megatron sequence parallelism cannot find the activation: pass sequence_parallel=False")
    return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}


class _Gather:
    """Forward pre-hook of a module holding column layers inside a block: a chunk input ->
    the whole sequence, once for all its column layers (sequence_shards.py)."""

    def __init__(self, shards: SequenceShards):
        self.shards = shards

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        shards = self.shards
        return _first_input(module, args, kwargs, lambda x: shards.gather(x) if shards.holds_chunk(x) else x)


class _FlatTokens:
    """Hooks of a module beside the experts of a MoE block (Qwen2-MoE's shared expert), which
    the block calls on its tokens flattened, this rank's chunk [b * s_pad/p, H]: the module
    gets them as [b, s_pad/p, H], the chunk its column / row pair gathers and reduce-scatters,
    and the block gets the output flattened back, in the order of its tokens (the order of a
    gate's output on the same flat chunk)."""

    def __init__(self, shards: SequenceShards):
        self.shards = shards
        self.flat: list[bool] = []  # per call in flight: whether its input came flat

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        def unflatten(x: torch.Tensor) -> torch.Tensor:
            self.flat.append(x.dim() == 2)
            if x.dim() != 2:
                return x
            rows = self.shards.padded(self.shards._length()) // self.shards.parts
            if x.shape[0] % rows != 0:
                raise ValueError(f"{type(module).__name__} got {x.shape[0]} flat tokens beside the experts of a MoE "
                                 f"block, not rows of this rank's chunk of {rows} positions; the block must flatten "
                                 f"its input [b, s/tp, H]: pass sequence_parallel=False")
            return x.view(x.shape[0] // rows, rows, x.shape[-1])

        return _first_input(module, args, kwargs, unflatten)

    def after(self, module: nn.Module, args: tuple, output):
        if self.flat.pop() and torch.is_tensor(output):
            return output.reshape(-1, output.shape[-1])
        return output


class _Enter:
    """Forward pre-hook of a list's first block: its hidden states [b, s, H] -> this rank's
    chunk. The first block of a pipeline stage after the first is given a stand-in of that
    shape instead (pipelined.py): it takes the chunk the stage received (``cut.chunk_in``)."""

    def __init__(self, shards: SequenceShards, cut=None):
        self.shards, self.cut = shards, cut

    def __call__(self, block: nn.Module, args: tuple, kwargs: dict):
        if self.cut is None or self.cut.chunk_in is None:
            return _first_input(block, args, kwargs, self.shards.split)
        return _first_input(block, args, kwargs, self._received)

    def _received(self, stand_in: torch.Tensor) -> torch.Tensor:
        self.shards.length = stand_in.shape[SEQ_DIM]  # this forward's sequence, as split() records it
        chunk, self.cut.chunk_in = self.cut.chunk_in, None
        return chunk


class _Leave:
    """Forward hook of a list's last block: its output chunk (or the first item of its output
    tuple) -> [b, s, H] on every tp rank. The last block of a pipeline stage before the last
    keeps the chunk as the stage's output (``cut.chunk_out``, what pipelined.py sends) and
    gives the model's remaining code (placeholders there) a zero stand-in of the whole shape."""

    def __init__(self, shards: SequenceShards, cut=None):
        self.shards, self.cut = shards, cut

    def __call__(self, block: nn.Module, args: tuple, output):
        leave = self._send if self.cut is not None and self.cut.sending else self.shards.join
        if isinstance(output, (tuple, list)):
            return type(output)((leave(output[0]), *output[1:]))
        return leave(output)

    def _send(self, chunk: torch.Tensor) -> torch.Tensor:
        self.cut.chunk_out = chunk
        shape = list(chunk.shape)
        shape[SEQ_DIM] = self.shards.length
        return chunk.detach().new_zeros(()).expand(shape)


class _JoinHiddenStates:
    """Forward hook of the model (and its base model): the ``hidden_states`` a transformers
    model returns with ``output_hidden_states=True`` are recorded at the blocks, where they are
    this rank's chunks; each chunk -> [b, s, H] on every tp rank (a tuple output, from
    ``return_dict=False``, is left as it is)."""

    def __init__(self, shards: SequenceShards):
        self.shards = shards

    def __call__(self, module: nn.Module, args: tuple, output):
        states = getattr(output, "hidden_states", None)
        if not isinstance(states, tuple) or not any(torch.is_tensor(h) and self.shards.holds_chunk(h) for h in states):
            return output
        output.hidden_states = tuple(self.shards.join(h) if torch.is_tensor(h) and self.shards.holds_chunk(h) else h
                                     for h in states)
        return output
