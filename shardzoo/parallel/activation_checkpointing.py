"""Activation checkpointing by ``parallelize(..., checkpointing=True)``.

Which modules are blocks: the children of the model's lists of repeated blocks, i.e. every
``nn.ModuleList`` / ``nn.ModuleDict`` whose children are all of one class (TinyLM's ``blocks``,
transformers' ``model.layers``), outermost only (a list inside a block, such as MoE experts,
is recomputed with its block). Finding them by structure needs no names from the user and
covers models of one's own and transformers models alike.

Each block's ``forward`` is replaced on the instance (names, hooks and state dicts unchanged)
by one that, in training with grad enabled, runs the original under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with a ``context_fn`` whose
recompute context

* re-enters the model's SDPA mode (sdpa_mode.py): the recompute runs in backward, outside the
  forward whose hooks entered it, and SDPA would otherwise see the local sequence shard only;
* replays the mesh's dropout streams (layers/recompute.py): torch's checkpoint restores its own
  generator, not the tp stream, so a grid layout's dropout would draw other masks;
* puts back the padding mask and packed documents of the block's own forward, which the
  sequence-parallel attention reads from the model's state (a later forward replaces them),
  and the sequence length of the sequence-sharded blocks (megatron_sp.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardzoo.layers.recompute import Reentrant, stream_contexts
from shardzoo.parallel.pipeline_cut import Placeholder
from shardzoo.parallel.sdpa_mode import sdpa_mode_of

BLOCK_LISTS = (nn.ModuleList, nn.ModuleDict)
SHARDS = "_shardzoo_sequence_shards"  # megatron_sp.py keeps a model's SequenceShards there


def shards_of(model: nn.Module):
    """The SequenceShards (layers/sequence_shards.py) of a model split with Megatron sequence
    parallelism, or None."""
    return model.__dict__.get(SHARDS)


def block_names(model: nn.Module) -> list[str]:
    """Qualified names of the blocks to checkpoint (module doc); raises when there are none."""
    names: list[str] = []
    lists: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, BLOCK_LISTS) or any(name.startswith(f"{outer}.") for outer in lists):
            continue
        # another pipeline stage's blocks are placeholders (pipeline_cut.py): not blocks here
        children = [(n, c) for n, c in module.named_children() if not isinstance(c, Placeholder)]
        if children and len({type(child) for _, child in children}) == 1:
            lists.append(name)
            names += [f"{name}.{child}" if name else child for child, _ in children]
    if not names:
        raise ValueError(f"parallelize(..., checkpointing=True) found no nn.ModuleList / nn.ModuleDict of blocks of "
                         f"one class in {type(model).__name__}; hold the repeated blocks in one, or checkpoint "
                         f"inside the model's own forward")
    return names


def install(block: nn.Module, model: nn.Module, state) -> None:
    """Run ``block`` under activation checkpointing in training (module doc). ``model``: the
    parallelized model (its SDPA mode); ``state``: its ``inputs.Parallelized``."""
    block.forward = CheckpointedForward(block, sdpa_mode_of(model), state, model.__dict__.get(SHARDS))


class CheckpointedForward:
    """A block's forward run under ``torch.utils.checkpoint`` (module doc); any arguments."""

    def __init__(self, block: nn.Module, mode, state, shards=None):
        self.block, self.forward, self.mode, self.state = block, block.forward, mode, state
        self.shards = shards  # the model's SequenceShards, or None

    def __call__(self, *args, **kwargs):
        if not (self.block.training and torch.is_grad_enabled()):
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=self.contexts, **kwargs)

    def contexts(self):
        """(forward, recompute) context managers, made anew for every checkpointed forward."""
        streams_forward, streams_recompute = stream_contexts(self.state.mesh)
        saved = (self.state.key_padding_mask, self.state.cu_seqlens)
        length = None if self.shards is None else self.shards.length
        recompute = Reentrant(lambda: _entered(_inputs_of(self.state, saved), _length_of(self.shards, length),
                                               self.mode, streams_recompute))
        return streams_forward, recompute

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.block).__name__})"


@contextlib.contextmanager
def _inputs_of(state, saved: tuple):
    """The sequence-parallel attention's inputs of the forward being recomputed, then back."""
    current = (state.key_padding_mask, state.cu_seqlens)
    state.key_padding_mask, state.cu_seqlens = saved
    try:
        yield
    finally:
        state.key_padding_mask, state.cu_seqlens = current


@contextlib.contextmanager
def _length_of(shards, length: int | None):
    """The sequence length of the forward being recomputed on the sequence-sharded blocks, then back."""
    if shards is None:
        yield
        return
    current, shards.length = shards.length, length
    try:
        yield
    finally:
        shards.length = current


@contextlib.contextmanager
def _entered(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield
