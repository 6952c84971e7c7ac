"""The engine step of shardzoo's own model families: one pipeline stage of a plain model split by
its plan, taking this rank's shards of its inputs.

``parallelize`` takes a whole model and the full tensors of a dp replica (its input hook splits
them); a family stage is given its token shards by the family's ``shard_input`` / ``shard_mask``
and may be one of several pipeline stages. So the stage builder takes the same module step
(``split_modules``) and adds only:

* the SDPA mode on its attention modules at every sp, sp = 1 included: every
  ``F.scaled_dot_product_attention`` call runs shardzoo's attention core (sdpa_mode.py), whose
  dropout mask is a function of the global batch row and head, so a stage drops what its
  serial twin drops in every layout;
* a forward pre-hook that takes the padding mask argument (``key_padding_mask``, this rank's
  [b, s] shard) out of the call into the mode's state: the plain forward gets None and calls
  SDPA without a mask tensor, and the attention core applies the mask to keys on every rank;
* activation checkpointing of the stage's blocks (activation_checkpointing.py);
* the same mask hook on each block, active only when the block is called on its own (outside
  the stage's forward, as a test or a probe running the blocks one by one does), so a block
  given this rank's shards and mask computes what it computes inside the stage.
"""

from __future__ import annotations

from torch import nn

from shardzoo.parallel import activation_checkpointing
from shardzoo.parallel import heads as head_counts
from shardzoo.parallel import sdpa_mode
from shardzoo.parallel.inputs import Parallelized
from shardzoo.parallel.parallelize import install_checkpointing, split_modules

MASK_ARG = "key_padding_mask"


def split_stage(model: nn.Module, mesh, plan: dict[str, str], *, sp_mode: str, causal: bool,
                checkpointing: bool = False, sequence_parallel: bool = True) -> Parallelized:
    """Split plain stage ``model`` over ``mesh`` (any tp layout, sp, pp) by ``plan``, in place.

    ``model.forward(x, key_padding_mask=None, ...)`` then takes this rank's shards: x [b, s]
    ids or [b, s, H_l] hidden, the mask bool [b, s] (True = attend) as its second positional
    argument or by name. Entries of ``plan`` for modules another stage holds are skipped.
    ``sequence_parallel``: Megatron sequence parallelism between the stage's blocks in 1d
    (megatron_sp.py; the stage's inputs and outputs stay replicated over tp). Returns the
    stage's state (its mesh, sp mode, current mask)."""
    planned, attention = split_modules(model, mesh, plan, causal=causal, checkpointing=checkpointing,
                                       partial=True, sequence_parallel=sequence_parallel)
    state = Parallelized(model, mesh, sp_mode, hf=False, causal=causal, head=None, embedding=None)
    sdpa_mode.install(model, state, attention)
    inside = StageMaskHooks(state)
    model.register_forward_pre_hook(inside.enter_stage, with_kwargs=True)
    model.register_forward_hook(inside.leave_stage, always_call=True)
    for name in activation_checkpointing.block_names(model):  # a stage holds at least one block
        inside.install(model.get_submodule(name))
    head_counts.make_local(attention)
    install_checkpointing(model, state, checkpointing)
    return state


class StageMaskHooks:
    """The mask hooks of a stage and its blocks: the stage's forward takes the padding mask
    argument; a block called outside it (the stage's depth 0) takes its own, as the stage's
    forward would; inside the stage's forward the block's hooks do nothing."""

    def __init__(self, state: Parallelized):
        self.state = state
        self.depth = 0  # stage forwards in flight

    def enter_stage(self, stage: nn.Module, args: tuple, kwargs: dict):
        self.depth += 1
        return _take_mask(self.state, args, kwargs)

    def leave_stage(self, stage: nn.Module, args: tuple, output) -> None:
        self.depth -= 1

    def install(self, block: nn.Module) -> None:
        block.register_forward_pre_hook(self.before, with_kwargs=True)

    def before(self, block: nn.Module, args: tuple, kwargs: dict):
        return _take_mask(self.state, args, kwargs) if self.depth == 0 else None


def _take_mask(state: Parallelized, args: tuple, kwargs: dict):
    """Move the padding mask from the forward's arguments to ``state`` (module doc)."""
    args, kwargs = list(args), dict(kwargs)
    if len(args) > 1:
        state.key_padding_mask, args[1] = args[1], None
    else:
        state.key_padding_mask = kwargs.pop(MASK_ARG, None)
    return tuple(args), kwargs
