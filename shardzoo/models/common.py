"""Pieces every model family shares: pipeline stage ranges, entering / leaving the mesh's
batch x sequence layout, per-mode embeddings and LM heads, loading full (serial) weights.

Token tensors (ids, masks, targets) ``[B, S]`` are split along the batch like the activations
of the tp_mode (``attention_tp.shard_rows``) and along the sequence over sp (zigzag order for
causal models, so ring attention is balanced).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardzoo.comm import ops
from shardzoo.layers import attention_tp as tpl
from shardzoo.layers.embedding_1d import VocabParallelEmbedding1D
from shardzoo.layers.embedding_2d import Embedding2D, VocabParallelEmbedding2D
from shardzoo.layers.embedding_2p5d import Embedding2p5D, VocabParallelEmbedding2p5D
from shardzoo.layers.embedding_3d import Embedding3D, VocabParallelEmbedding3D
from shardzoo.layers.head_1d import ParallelLMHead1D
from shardzoo.layers.head_2d import LMHead2D
from shardzoo.layers.head_2p5d import LMHead2p5D
from shardzoo.layers.head_3d import LMHead3D
from shardzoo.layers.sequence import gather_sequence, to_zigzag_order
from shardzoo.layers.shard_spec import get_shard_spec

_VOCAB = {"1d": VocabParallelEmbedding1D, "2d": VocabParallelEmbedding2D, "2.5d": VocabParallelEmbedding2p5D,
          "3d": VocabParallelEmbedding3D}
_HIDDEN = {"2d": Embedding2D, "2.5d": Embedding2p5D, "3d": Embedding3D}
_LM_HEAD = {"1d": ParallelLMHead1D, "2d": LMHead2D, "2.5d": LMHead2p5D, "3d": LMHead3D}


# -- pipeline stages -------------------------------------------------------------------------
def stage_blocks(who: str, num_blocks: int, stage: tuple[int, int] | None,
                 stage_layers: list[int] | None) -> tuple[range, bool, bool]:
    """(global block indices, holds the embeddings, holds the head) of one pipeline stage.

    ``stage=(k, n)``: stage k of n, blocks split evenly (the first ``num_blocks % n`` stages get
    one more); ``stage_layers``: blocks per stage, e.g. [3, 5]. Neither: the whole model."""
    if stage is None:
        if stage_layers is not None:
            raise ValueError(f"{who}: stage_layers={stage_layers} needs stage=(k, n) to say which stage to build")
        return range(num_blocks), True, True
    k, n = stage
    if not (isinstance(n, int) and n >= 1 and 0 <= k < n):
        raise ValueError(f"{who}: stage={stage} must be (k, n) with 0 <= k < n")
    if n > num_blocks:
        raise ValueError(f"{who} has {num_blocks} blocks and cannot be split into {n} pipeline stages (every stage "
                         f"needs at least one block); use pp <= {num_blocks} or a deeper model")
    if stage_layers is None:
        base, extra = divmod(num_blocks, n)
        stage_layers = [base + (1 if i < extra else 0) for i in range(n)]
    if len(stage_layers) != n or sum(stage_layers) != num_blocks or min(stage_layers) < 1:
        raise ValueError(f"{who}: stage_layers={stage_layers} must list {n} positive block counts summing to "
                         f"{num_blocks}")
    first = sum(stage_layers[:k])
    return range(first, first + stage_layers[k]), k == 0, k == n - 1


def check_seq_len(who: str, seq: int, max_positions: int, field: str) -> None:
    """Raise when a sequence is longer than the learned position table."""
    if seq > max_positions:
        raise ValueError(f"{who}: sequence length {seq} exceeds {field}={max_positions} (the learned position "
                         f"table); truncate the input to {max_positions} tokens or use a config with a larger {field}")


# -- tokens in and out ------------------------------------------------------------------------
def shard_tokens(t_full: torch.Tensor, mesh, layout, zigzag: bool) -> torch.Tensor:
    """[B, S, ...] ids / masks / targets -> this rank's [b, s, ...] (no gradient)."""
    t = tpl.shard_rows(t_full, mesh, layout)
    world = mesh.sp_size
    if world == 1:
        return t
    parts = 2 * world if zigzag else world
    if t.shape[1] % parts:
        raise ValueError(f"sequence length {t.shape[1]} is not divisible by {parts}, which "
                         f"{'zigzag' if zigzag else 'contiguous'} sharding over sp={world} needs; pad the sequence "
                         f"to a multiple of {parts} (padding mask False on the pad)")
    if zigzag:
        t = to_zigzag_order(t, world, 1)
    return ops.split_local(t, mesh.sp_group, 1)


def gather_tokens(y_local: torch.Tensor, mesh, layout, zigzag: bool) -> torch.Tensor:
    """Inverse of :func:`shard_tokens` for float outputs [b, s, ...] (differentiable)."""
    y = tpl.gather_rows(y_local, mesh, layout)
    return gather_sequence(y, mesh.sp_group, 1, zigzag=zigzag)


# -- embeddings and heads ---------------------------------------------------------------------
def vocab_embedding(serial: nn.Embedding, mesh, layout, device=None) -> nn.Module:
    """A token table split along the vocabulary (and the hidden in grid modes)."""
    if mesh.tp_mode == "1d":
        return VocabParallelEmbedding1D.from_serial(serial, mesh, device=device)
    return _VOCAB[mesh.tp_mode].from_serial(serial, mesh, device=device, layout=layout)


def hidden_embedding(serial: nn.Embedding, mesh, layout, device=None) -> nn.Module:
    """A small table (positions, token types) whose output follows the activation layout:
    replicated in 1D (every tp rank holds the whole table), hidden-split in grid modes."""
    if mesh.tp_mode == "1d":
        return serial.to(device) if device is not None else serial
    return _HIDDEN[mesh.tp_mode].from_serial(serial, mesh, device=device, layout=layout)


def lm_head(in_features: int, vocab_size: int, mesh, layout, *, tie_to=None, serial: nn.Linear | None = None,
            device=None) -> nn.Module:
    """Vocabulary-parallel LM head, sharing ``tie_to``'s table or built from ``serial``."""
    cls = _LM_HEAD[mesh.tp_mode]
    extra = {"layout": layout} if mesh.tp_mode == "3d" else {}
    if tie_to is not None:
        return cls(in_features, vocab_size, False, mesh=mesh, tie_to=tie_to, **extra)
    return cls.from_serial(serial, mesh, device=device, **extra)


def head_output_layout(head: nn.Module, layout):
    """The batch layout of an LM head's logits (3D swaps the batch axes)."""
    return tpl.layout_after(head, layout)


# -- weights ------------------------------------------------------------------------------------
@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Copy full-size (serial) tensors into this rank's pieces, through each ShardSpec.

    Only the parameters and buffers this stage holds are read; ``strict`` raises when one of
    them is missing from ``state``. Returns the names of ``state`` that were not used."""
    used = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in state:
            if strict:
                raise KeyError(f"load_full_state_dict: {name} is missing from the state dict")
            continue
        full = state[name].to(t.dtype)
        spec = get_shard_spec(model, name)
        t.copy_(spec.take(full) if spec is not None else full)
        used.add(name)
    return [n for n in state if n not in used]


def reorder_positions(positions: torch.Tensor, mesh, zigzag: bool) -> torch.Tensor:
    """Natural-order positions [S] -> this sp rank's [S/P] (helper for custom inputs)."""
    if zigzag and mesh.sp_size > 1:
        positions = to_zigzag_order(positions, mesh.sp_size, 0)
    return ops.split_local(positions, mesh.sp_group, 0) if mesh.sp_size > 1 else positions


def relayout(x: torch.Tensor, mesh, src, dst) -> torch.Tensor:
    """Move an activation from layout ``src`` to ``dst`` (3D, after an odd number of linears
    where a tied table fixes the layout): gather to full and keep the ``dst`` block.
    Differentiable; costs one all-gather of the activation, so models use it once at most."""
    if src == dst or src is None:
        return x
    return tpl.shard_hidden(tpl.gather_hidden(x, mesh, src), mesh, dst)


def dense(serial: nn.Linear, mesh, layout, device=None) -> nn.Module:
    """A square-ish projection that must leave the activation in its input layout (poolers,
    MLM transforms, OPT's project_in / project_out): replicated in 1D (activations are
    replicated there), the mode's linear otherwise (run with :func:`run_dense`)."""
    if mesh.tp_mode == "1d":
        return serial.to(device) if device is not None else serial
    return tpl.tp_linear(serial, mesh, layout, "column", device)


def run_dense(module: nn.Module, x: torch.Tensor, mesh, layout) -> torch.Tensor:
    """``module(x)`` back in ``layout`` (3D linears swap the layout; :func:`relayout` undoes it)."""
    return relayout(module(x), mesh, tpl.layout_after(module, layout), layout)


def vocab_bias(owner: nn.Module, head: nn.Module, vocab_size: int, mesh, layout, device=None) -> nn.Parameter:
    """Register ``owner.bias``: a zero output bias [V] split like ``head``'s vocab-parallel
    logits (BERT's ``cls.predictions.bias``); add it with :func:`add_vocab_bias`."""
    from shardzoo.layers.shard_spec import ShardSpec, shard_param

    per_rank = getattr(head, "vocab_per_rank")
    out = tpl.layout_after(head, layout)
    part = ("tp",) if out is None else (out.hidden_axis,)
    repl = () if out is None else out.batch_axes
    spec = ShardSpec((vocab_size,), (head.vocab_start,), (per_rank,), part, repl)
    return shard_param(owner, "bias", torch.zeros(vocab_size, device=device), spec)


def add_vocab_bias(logits: torch.Tensor, bias: torch.Tensor, head: nn.Module, mesh, layout) -> torch.Tensor:
    """logits + bias; in grid modes each rank holds other batch rows, so the bias gradient is
    summed over the batch axes."""
    out = tpl.layout_after(head, layout)
    if out is not None:
        from shardzoo.layers.layouts import use_block_param

        bias = use_block_param(bias, mesh, out)
    return logits + bias


def rename_block_param(name: str, pattern: re.Pattern, table: list[tuple[str, str]],
                       to_ours: bool) -> str | None:
    """Rename a per-block parameter between Hugging Face and shardzoo names.

    ``pattern`` matches ``<prefix>.<i>.<module>.<param>`` as groups (prefix.i, module, param);
    ``table`` lists (hf module, shardzoo module) pairs. Returns None when nothing matches."""
    m = pattern.match(name)
    if not m:
        return None
    for hf, ours in table:
        if m.group(2) == (hf if to_ours else ours):
            return f"{m.group(1)}.{ours if to_ours else hf}.{m.group(3)}"
    return None
