"""The ``vocab_bias`` style: a module holding an output bias [V] of its own that its forward adds
to the logits of a vocabulary-parallel head (``self.decoder(x) + self.bias``: BERT's
``cls.predictions``, whose ``decoder`` is tied to the word embeddings and so has no bias).

Each rank's logits hold the head's vocabulary block [.., V_local], so the bias is replaced by
the same block of it: a parameter with a ShardSpec split like the logits' vocabulary (zero past
the vocabulary's end where the head pads it). Where the logits' batch is split over tp axes
(the grids) every rank of those axes holds the same block, and a forward pre-hook hands the
forward the bias through ``copy_to`` over them (identity forward, gradient summed in backward),
as ``replicate_sum`` does. The head is the ``lm_head`` planned inside the module, or else the
plan's only ``lm_head``. The module's children are left to the plan.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers.placements import use_block_param
from shardzoo.layers.shard_spec import ShardSpec, shard_param


def check_vocab_bias(name: str, module: nn.Module, pattern: str) -> None:
    """Raise unless ``module`` holds a 1-d parameter ``bias`` of its own."""
    bias = module._parameters.get("bias")
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
        raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a 'vocab_bias', which needs a "
                         f"1-d parameter 'bias' [vocab] of the module's own (registered on it, not on a child); "
                         f"change the style or the pattern")


def head_of_bias(name: str, module: nn.Module, planned: dict) -> str:
    """The qualified name of the 'lm_head' whose logits ``module`` (planned 'vocab_bias' as
    ``name``) adds its bias to: the one planned inside it, else the plan's only one; raises
    when there is none or the vocabulary sizes differ."""
    heads = [n for n, (_, style, _) in planned.items() if style == "lm_head"]
    inside = [n for n in heads if n.startswith(f"{name}.")]
    found = inside or heads
    if len(found) != 1:
        raise ValueError(f"{name} is planned 'vocab_bias', which adds to the logits of one 'lm_head'; found "
                         f"{found or 'none'}. Plan the head the bias belongs to 'lm_head' (inside {name} or as "
                         f"the model's only one)")
    head = planned[found[0]][0]
    vocab = module._parameters["bias"].shape[0]
    if head.out_features != vocab:
        raise ValueError(f"{name}.bias has {vocab} entries but its head {found[0]} gives {head.out_features} "
                         f"logits; a 'vocab_bias' has one entry per vocabulary row")
    return found[0]


class BiasOverBatch:
    """Pre-hook and hook: the forward reads ``bias`` with its gradient summed over the batch
    axes of the logits (module doc), then the parameter is put back."""

    def __init__(self, mesh, placement):
        self.mesh, self.placement = mesh, placement
        self.saved: list = []  # a stack: the module may run inside itself

    def before(self, module: nn.Module, args: tuple) -> None:
        bias = module._parameters["bias"]
        self.saved.append(bias)
        module._parameters["bias"] = use_block_param(bias, self.mesh, self.placement)

    def after(self, module: nn.Module, args: tuple, output) -> None:
        module._parameters["bias"] = self.saved.pop()


def install_vocab_bias(module: nn.Module, head: nn.Module, layout) -> None:
    """Replace ``module.bias`` [V] by this rank's block of it, split like the logits of
    ``head`` (the built vocabulary-parallel head); in place."""
    serial = module._parameters["bias"]
    out = layout.after(head)
    spec = ShardSpec((serial.shape[0],), (head.vocab_start,), (head.vocab_per_rank,), (out.hidden_axis,),
                     out.batch_axes)
    shard_param(module, "bias", serial, spec)
    module.mesh = layout.mesh  # the mesh the spec's axes refer to (checkpoints read it from the owning module)
    if out.batch_axes:
        hooks = BiasOverBatch(layout.mesh, out)
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after, always_call=True)
