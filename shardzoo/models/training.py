"""Training utilities: global gradient norm / clipping across tp, pp, dp and sp shards, gradient
averaging by hand, and bf16 autocast.

Gradient convention: ``model.loss`` returns the global token mean and scales the gradient it
backpropagates on each rank (this rank's sum over the global count, times dp x sp; see
layers/batch_loss.py), so the gradient of the global mean is the *average* of the ranks'
gradients over the dp and sp axes; ``shardzoo.data_parallel`` (shardzoo/parallel) averages over
``mesh.group("dp", "sp")``, which does exactly that, and :func:`average_grads` does it by hand.
Pipeline stages with tied embeddings also need ``pipeline.sync_tied_grads``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.layers.dp_shard import local_tensor, rank_piece
from shardzoo.layers.replicas import copy_axes
from shardzoo.layers.shard_spec import get_shard_spec, is_repeated_copy
from shardzoo.parallel import pipeline_cut


def global_grad_norm(models: nn.Module | list[nn.Module], mesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, as the serial model would compute it, on every
    rank (collective over the world). Each distinct piece of each parameter counts once: a
    rank adds a piece only when it is the first copy along the axes the piece is repeated
    over (ShardSpec; a gradient FSDP2 sharded over dp is partitioned there too), and an
    untied copy of a tied table on the last stage is skipped."""
    models = models if isinstance(models, (list, tuple)) else [models]
    device = next(p for m in models for p in m.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for model in models:
        model = getattr(model, "module", model)  # a DDP wrapper built by hand
        skip = set()
        if not getattr(model, "is_first", True):
            skip = set(getattr(model, "tied_names", {}))
        cut = pipeline_cut.cut_of(model)
        if cut is not None and cut.tied and not cut.holds_first and cut.head is not None:
            skip = {f"{cut.head}.weight"}  # the first stage counts the table
        for name, p in model.named_parameters():
            if p.grad is None or name in skip or is_repeated_copy(model, name):
                continue
            g, spec = rank_piece(p.grad.detach(), get_shard_spec(model, name), mesh, name)
            axes = copy_axes(spec, mesh)
            if axes and mesh.rank(*axes) != 0:
                continue
            if g.numel() == 0:  # FSDP2 left this rank no rows of a short tensor
                continue
            g = g.double()
            if norm_type == math.inf:
                total = torch.maximum(total, g.abs().max())
            else:
                total += g.abs().pow(norm_type).sum()
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dist.all_reduce(total, op=op)
    return total if norm_type == math.inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(models: nn.Module | list[nn.Module], max_norm: float, mesh,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient by ``max_norm / global norm`` when the norm exceeds ``max_norm``
    (``torch.nn.utils.clip_grad_norm_`` semantics on the global norm). Returns the norm."""
    norm = global_grad_norm(models, mesh, norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for model in models if isinstance(models, (list, tuple)) else [models]:
        for p in model.parameters():
            if p.grad is not None:
                local_tensor(p.grad).mul_(coef.to(p.grad.dtype))
    return norm.float()


@torch.no_grad()
def average_grads(models: nn.Module | list[nn.Module], mesh) -> None:
    """Average gradients over the dp x sp group in place, one all-reduce per parameter: for
    custom loops that neither use ``shardzoo.data_parallel`` nor run a schedule. After
    ``model.loss`` the result is the gradient of the global token mean."""
    if mesh.size("dp", "sp") == 1:
        return
    group, n = mesh.group("dp", "sp"), mesh.size("dp", "sp")
    for model in models if isinstance(models, (list, tuple)) else [models]:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(n)


def autocast(enabled: bool = True, dtype: torch.dtype = torch.bfloat16):
    """``torch.autocast`` for the device of the default process group (bf16 by default);
    parameters stay fp32, matmuls run in bf16, the loss kernels accumulate in fp32."""
    if not enabled:
        return contextlib.nullcontext()
    device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return torch.autocast(device_type, dtype=dtype)
