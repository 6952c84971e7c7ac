"""The gradient reductions of a pipeline step, outside torch's schedules: the tied table's two
copies summed between the first and last stage; the stages' gradients averaged over dp after a
split backward (DDP's reducer does not follow it); experts split over ep averaged over edp once
per step; and FSDP2's reduction held through the schedule and run once after it
(parallel/pipelined.py, models/pipeline.py).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.layers.dp_shard import local_tensor
from shardzoo.layers.experts import ExpertsEP

_tied_groups: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def tied_group(mesh):
    """The group of this rank's first and last pipeline stages (same dp / sp / tp coordinate);
    created once per mesh, collectively on every rank."""
    if mesh not in _tied_groups:
        grid = mesh.device_mesh.mesh  # [dp, pp, sp, *tp]
        mine = None
        others = [range(s) for d, s in enumerate(grid.shape) if d != 1]
        for idx in itertools.product(*others):
            line = grid[(idx[0], slice(None)) + tuple(idx[1:])].tolist()
            ranks = sorted({line[0], line[-1]})
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if dist.get_rank() in ranks:
                mine = group
                mesh.adopt_group(group)
        _tied_groups[mesh] = mine
    return _tied_groups[mesh]


def sum_tied_grad(param, mesh) -> None:
    """Sum ``param``'s gradient (a tied table's, or its copy's) between this rank's first and last
    pipeline stage (:func:`tied_group`); FSDP2's sharded gradient by its local rows, which both
    stages hold alike."""
    if param is not None and param.grad is not None:
        dist.all_reduce(local_tensor(param.grad), group=tied_group(mesh))


@torch.no_grad()
def average_over_dp(views: list[nn.Module], info) -> None:
    """Average the gradients of ``views`` (stage views, or a family's stages) over the group of
    ``info`` (a DataParallelInfo), one all-reduce per dtype (what DDP does in the last
    micro-batch's backward under the other schedules). Experts split over ep are left out: they
    are averaged over edp (:func:`average_experts`)."""
    skip = {id(p) for m in experts_of(views) for p in m.parameters()}
    _average([p.grad for v in views for p in v.parameters() if p.grad is not None and id(p) not in skip],
             info.group, info.mesh.size(*info.axes))


def experts_of(views: list[nn.Module]) -> list[ExpertsEP]:
    """The experts layers split over ep (layers/experts.py) inside ``views``."""
    return [m for v in views for m in v.modules() if isinstance(m, ExpertsEP)]


@torch.no_grad()
def average_experts(experts: list[ExpertsEP], mesh) -> None:
    """Average the gradients of ``experts`` over the expert data parallel group (edp) once per
    step, where ``ExpertsEP`` would otherwise do it in every micro-batch's backward."""
    if experts and mesh.size("edp") > 1:
        _average([p.grad for m in experts for p in m.parameters() if p.grad is not None], mesh.group("edp"),
                 mesh.size("edp"))


def _average(grads: list[torch.Tensor], group, size: int) -> None:
    """Average ``grads`` in place over ``group`` of ``size`` ranks, one all-reduce per dtype."""
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for g, piece in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(piece.view_as(g))


def _fsdp_sync(root, on: bool) -> None:
    """FSDP2's gradient reduction and resharding after backward, on or off for every unit
    under ``root`` (off: each micro-batch's weight pass adds to whole gradients)."""
    root.set_requires_gradient_sync(on)
    root.set_reshard_after_backward(on)
    root.set_is_last_backward(on)


def _fsdp_groups(root) -> list:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    groups = [fully_shard.state(m)._fsdp_param_group for m in root.modules() if isinstance(m, FSDPModule)]
    return [g for g in groups if g is not None]


def hold_gathered(root) -> list:
    """Every FSDP2 unit under ``root`` keeps its parameters gathered from its first forward
    until :func:`release_gathered`: a split backward's weight pass finds the parameters the
    forward used only while they stay gathered (ZeRO 3 runs as ZeRO 2 within the step). Returns
    each unit's resharding, for :func:`release_gathered`."""
    groups = _fsdp_groups(root)
    resharding = [g.post_forward_mesh_info for g in groups]
    root.set_reshard_after_forward(False)
    return resharding


def release_gathered(root, resharding: list) -> None:
    """Each FSDP2 unit under ``root`` reshards after forward again as it did before
    :func:`hold_gathered`."""
    for group, info in zip(_fsdp_groups(root), resharding):
        group.post_forward_mesh_info = info


def fsdp_hold(root, gathered: bool) -> list | None:
    """Before a pipelined step: every FSDP2 unit adds each micro-batch's gradients to whole ones
    instead of reduce-scattering them; with ``gathered`` (a split backward) it also keeps its
    parameters gathered until the step's end (:func:`hold_gathered`). Returns each unit's
    resharding then, else None."""
    root.set_requires_gradient_sync(False)
    root.set_is_last_backward(False)
    if not gathered:
        return None
    root.set_reshard_after_backward(False)
    return hold_gathered(root)


def fsdp_reduce(root, resharding: list | None) -> None:
    """After a pipelined step: reduce-scatter every unit's whole gradients and reshard its
    parameters, as FSDP2's post-backward does after an ordinary backward (torch's pipeline stage
    does the same for a stage that is itself an FSDP module), and restore each unit's resharding."""
    from torch.distributed.fsdp import fully_shard

    _fsdp_sync(root, True)
    state = fully_shard.state(root)
    for unit in state._state_ctx.all_states:
        for group in unit._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    if resharding is not None:
        release_gathered(root, resharding)
