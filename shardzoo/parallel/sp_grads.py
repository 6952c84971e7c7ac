"""Gradients over sp, right after ``loss.backward()``: no wrapper to remember.

The sp ranks hold the same parameters and other tokens of the same rows, so each rank's
gradient is a partial one. The loss every rank backpropagates is ``R * local_sum / N`` with R
the size of dp x sp (layers/batch_loss.py), so the serial gradient is the *average* over sp of
the ranks' gradients (over dp too, which ``shardzoo.data_parallel`` adds).

Every parameter gets a tensor hook that averages its incoming gradient over the sp group
before it is accumulated into ``.grad``: accumulation over micro-batches stays exact, DDP's
and FSDP2's own reductions see the averaged gradient (and averaging equal values again over
sp changes nothing). The hooks are registered from a forward pre-hook on the model, for any
parameter not hooked yet, so parameters replaced after ``parallelize`` (``from_pretrained``
materializing the meta model, ``load_state_dict(assign=True)``) are hooked too. A model handed
to FSDP2 (``data_parallel(zero >= 2)``) is left to FSDP2, whose reduction averages over dp x sp.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from shardzoo.comm import ops
from shardzoo.layers.experts import ExpertsEP

# Set on a model ``data_parallel`` gave to FSDP2 (zero >= 2): FSDP2 reduces every gradient over
# dp x sp itself, and its root unit's parameters are plain tensors while it runs, which the
# hooks would otherwise average a second time.
FSDP_AVERAGES_SP = "_shardzoo_fsdp_averages_sp"


def install(model: nn.Module, mesh) -> None:
    """Average the gradient of every parameter of ``model`` over ``mesh``'s sp group in every
    backward (nothing to do when sp = 1)."""
    if mesh.sp_size == 1:
        return
    group, size = mesh.sp_group, mesh.sp_size
    hooked: dict[int, weakref.ref] = {}

    def average(grad: torch.Tensor) -> torch.Tensor:
        return ops.all_reduce(grad, group).div_(size)

    def hook_new_parameters(module, args) -> None:
        if module.__dict__.get(FSDP_AVERAGES_SP):  # FSDP2's reduce-scatter over dp x sp does it
            return
        experts = {id(p) for m in module.modules() if isinstance(m, ExpertsEP) for p in m.parameters()}
        for p in module.parameters():
            if id(p) in experts:  # reduced over edp by their own layer (layers/experts.py)
                continue
            seen = hooked.get(id(p))
            if (seen is not None and seen() is p) or not p.requires_grad or _is_dtensor(p):
                continue
            p.register_hook(average)
            hooked[id(p)] = weakref.ref(p)

    model.register_forward_pre_hook(hook_new_parameters)


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)
