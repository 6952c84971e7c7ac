"""A transformers MoE causal LM's router logits and load-balancing loss under sp and Megatron
sequence parallelism (1d, tp > 1): the serial ones over this replica's whole sequences.

The model's own code computes the loss (``load_balancing_loss_func`` in its forward) from
the router logits its base model returns (recorded by transformers' output capturing) and
from the ``attention_mask`` its forward gets. Under sp, and under Megatron sequence
parallelism, a rank's router sees its chunk of the sequence, so:

* a forward hook on the base model replaces each layer's router logits [b*c, E] of this
  rank's chunk by the whole sequences' [b*S, E] (rows in the serial order: batch row, then
  position), gathered over tp (the Megatron chunks) and over sp;
* under sp the model's forward gets this replica's [b, S] padding mask (inputs.py,
  ``whole_mask_to_model``), and a pre-hook on the base model takes it away again (the base
  model's attention gets the padding mask through shardzoo's sp attention, hf_attention.py).

Every tp and sp rank then computes the same loss from the same tensors. The gathers' backward
keeps this rank's slice of the gradient: over tp that is the gradient of its chunk (the
router's gradient is summed over tp, styles/experts.py); over sp it is scaled by sp, since
the parameters' gradients are averaged over sp (sp_grads.py) and the serial gradient of the
replica's aux loss is the sum over the sp ranks of their (equal) gradients. Gradients through the returned ``router_logits`` are right
for any loss every sp rank computes alike from them, as the model's own does.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardzoo.parallel.activation_checkpointing import shards_of
from shardzoo.parallel.inputs import gather_over_sp


def install(model: nn.Module, state, causal_lm: bool) -> None:
    """Under sp or Megatron sequence parallelism, make ``model``'s (a transformers model with
    ``config.output_router_logits``) router logits and load-balancing loss the serial ones
    (module doc); a MoE model that is not a causal LM over a base model is refused
    ``output_router_logits=True`` instead."""
    shards = shards_of(model)
    if (state.mesh.sp_size == 1 and shards is None) or not hasattr(model.config, "output_router_logits"):
        return
    base = getattr(model, "base_model", None)
    if not causal_lm or base is None or base is model:
        model.register_forward_pre_hook(functools.partial(_refuse, state), with_kwargs=True)
        return
    state.whole_mask_to_model = state.mesh.sp_size > 1
    shape: dict[str, tuple[int, int]] = {}
    base.register_forward_pre_hook(functools.partial(_base_inputs, shape, state.mesh.sp_size > 1), with_kwargs=True)
    base.register_forward_hook(functools.partial(_gather_router_logits, state, shards, shape))


def _base_inputs(shape: dict, drop_mask: bool, module, args, kwargs):
    """Record this rank's [b, s] tokens; under sp the base model gets no padding mask (module doc)."""
    first = kwargs.get("input_ids")
    first = kwargs.get("inputs_embeds") if first is None else first
    first = args[0] if first is None and args and torch.is_tensor(args[0]) else first
    if first is not None:
        shape["tokens"] = tuple(first.shape[:2])
    if drop_mask and kwargs.get("attention_mask") is not None:
        kwargs = {**kwargs, "attention_mask": None}
        return args, kwargs
    return None


def _gather_router_logits(state, shards, shape: dict, module, args, output):
    logits = getattr(output, "router_logits", None)
    if not logits or "tokens" not in shape:
        return None
    b, s = shape["tokens"]
    output.router_logits = tuple(gather_router_logits(state, shards, layer, b, s) for layer in logits)
    return output


def gather_router_logits(state, shards, local: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """One layer's router logits of this rank's chunk, [b*c, E] (rows: batch row, then position
    in the chunk; c = s, or s's Megatron chunk under ``shards``), of the [b, s] tokens this sp
    rank holds -> the replica's whole sequences' [b*S, E] in the serial order, on every rank."""
    chunk = shards.padded(s) // shards.parts if shards is not None else s
    if local.shape[0] != b * chunk:
        raise ValueError(f"router logits of {local.shape[0]} rows for {b} x {chunk} tokens: shardzoo gathers a "
                         f"MoE model's router logits when its router returns one row per token")
    x = local.reshape(b, chunk, -1)
    if shards is not None:
        x = shards.join(x)  # backward: this tp rank's chunk of the gradient
    full = gather_over_sp(state, x, state.cu_seqlens)  # the gradient sp times larger: see the module doc
    return full.reshape(-1, full.shape[-1])


def _refuse(state, model, args, kwargs):
    """Only a causal LM over a base model has its load-balancing loss made serial under sp."""
    wanted = kwargs.get("output_router_logits")
    if wanted if wanted is not None else getattr(model.config, "output_router_logits", False):
        raise ValueError(f"output_router_logits=True with sp={state.mesh.sp_size}, tp={state.mesh.tp_size}: the "
                         f"router logits of {type(model).__name__} would be each rank's chunk of the tokens; shardzoo "
                         f"gathers them for a causal LM (a *ForCausalLM over its base model) only; pass "
                         f"output_router_logits=False (and set model.config.output_router_logits = False), or use "
                         f"sp=1 and sequence_parallel=False")
