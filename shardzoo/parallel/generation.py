"""``model.generate`` on a parallelized transformers model: the generation loop reads whole
logits.

transformers' ``generate`` takes the argmax (or samples, or applies its logits processors)
over ``outputs.logits[:, -1, :]`` and appends one token per row of the full batch. A
parallelized model's logits are this rank's vocabulary block (and, in the grid layouts, this
rank's batch rows), so while ``generate`` runs, a forward hook hands the loop
``gather_logits(...)``: [B, S, V] on every rank, the same numbers on all of them, so every rank
appends the same token. Outside ``generate`` the logits stay this rank's block.

The KV cache needs nothing: with sp = 1 each rank's attention holds whole heads of the whole
sequence of its batch rows, and every step splits the batch the same way, so a cache of this
rank's heads is a cache of the sequence. Under sp each step's one new token cannot be split
over the sp ranks, so ``generate`` is refused, naming sp and the fix.
"""

from __future__ import annotations

import types

from torch import nn

from shardzoo.parallel import inputs

_STATE = "_shardzoo_parallel"
_GENERATING = "_shardzoo_generating"


def install(model: nn.Module, state: inputs.Parallelized) -> None:
    """``model.generate`` (an instance method calling the class's own) and the hook that
    gathers the logits while it runs; a model without a head or without ``generate`` is left
    alone."""
    if state.head is None or not callable(getattr(type(model), "generate", None)):
        return
    model.generate = types.MethodType(_generate, model)  # a bound method: copy.deepcopy rebinds it
    model.register_forward_hook(_whole_logits)


def _generate(model: nn.Module, *args, **kwargs):
    state = model.__dict__[_STATE]
    if state.mesh.sp_size > 1:
        raise ValueError(f"{type(model).__name__}.generate is not supported under sequence parallelism "
                         f"(sp={state.mesh.sp_size}): each step feeds one new token, which cannot be split over the "
                         f"sp ranks. Generate with sp=1: load the weights into a mesh without sp (e.g. "
                         f"shardzoo.from_pretrained(dir, ParallelMesh(tp=...)), or checkpoint.load into a model "
                         f"parallelized on such a mesh)")
    model.__dict__[_GENERATING] = True
    try:
        return type(model).generate(model, *args, **kwargs)
    finally:
        model.__dict__[_GENERATING] = False


def _whole_logits(model: nn.Module, args, output):
    """While ``generate`` runs: ``output.logits`` gathered to the full [B, S, V] on every rank
    (``gather_logits`` drops the rows a small batch was padded with in the grid layouts)."""
    if not model.__dict__.get(_GENERATING) or getattr(output, "logits", None) is None:
        return output
    output.logits = inputs.gather_logits(model, output.logits)
    return output
