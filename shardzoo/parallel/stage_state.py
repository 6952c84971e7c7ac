"""``shardzoo.full_state_dict`` of a model cut into pipeline stages: every stage's tensors.

The layers' ``full_state_dict`` gathers each tensor over the axes it is split on (tp, and dp
under FSDP2) and returns the tensors of the modules this rank holds. A model that
``parallelize`` cut into pipeline stages (pipeline_cut.py) holds its own stages only, so its
full state is the union over the pp group: one ``all_gather_object`` of each rank's gathered
tensors (CPU copies). A model not cut is returned as the layers' function returns it (the
families' stages keep their per-stage full state).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.layers import full_state
from shardzoo.layers.shard_spec import unwrap_ddp
from shardzoo.parallel.pipeline_cut import cut_of


def full_state_dict(module: nn.Module, *, check_replicas: bool = False) -> dict[str, torch.Tensor]:
    """Serial-named, full-size state dict of any (parallel) module, on every rank; for a model
    cut into pipeline stages, of every stage (module doc). Collective over the world."""
    full = full_state.full_state_dict(module, check_replicas=check_replicas)
    model = unwrap_ddp(module)
    cut = cut_of(model)
    state = model.__dict__.get("_shardzoo_parallel")
    if cut is None or state is None or state.mesh.pp_size == 1:
        return full
    pieces: list = [None] * state.mesh.pp_size
    dist.all_gather_object(pieces, {k: v.detach().cpu() for k, v in full.items()}, group=state.mesh.pp_group)
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        merged.update(piece)
    device = next(iter(full.values())).device if full else torch.device("cpu")
    return {k: v.to(device) for k, v in merged.items()}
