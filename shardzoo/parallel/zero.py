"""The optimizer for a ZeRO stage, and gradient accumulation without a reduce per micro-batch.

``zero_optimizer(model, torch.optim.AdamW, lr=...)`` is the optimizer to build after
``data_parallel``: for zero=1 a ``ZeroRedundancyOptimizer`` over the dp (x sp) group (each
rank keeps the state of about 1/N_d of the parameters, whole parameters, and broadcasts its
updated ones after the step); with expert parallelism one optimizer over two of them, the
experts' state partitioned over the expert data parallel group edp (expert_zero.py);
otherwise the plain optimizer, whose state FSDP2's DTensor parameters already shard
(zero >= 2) or which DDP replicates (zero=0).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardzoo.layers.experts import ExpertsEP
from shardzoo.parallel.data_parallel import ddp_of, info_of
from shardzoo.parallel.expert_zero import ExpertZeroOptimizer


def _models(models) -> list[nn.Module]:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def zero_optimizer(models: nn.Module | list[nn.Module], optimizer_class=torch.optim.AdamW, **defaults):
    """The optimizer over the parameters of ``models`` (a model or this rank's pipeline
    stages, each passed through :func:`shardzoo.data_parallel`) for their ZeRO stage:
    ``ZeroRedundancyOptimizer(params, optimizer_class, process_group=<dp x sp>, **defaults)``
    for zero=1 (with experts split over ep: an :class:`ExpertZeroOptimizer`, the experts'
    state partitioned over edp, the rest over dp x sp; one object with the plain optimizer's
    ``param_groups``), ``optimizer_class(params, **defaults)`` otherwise. Raises when the
    models were not wrapped, or were wrapped with different stages or meshes."""
    infos = [info_of(m) for m in _models(models)]
    if any(i is None for i in infos):
        raise ValueError("zero_optimizer needs models passed through shardzoo.data_parallel(model, mesh, zero=...) "
                         "first (it reads the ZeRO stage and the dp group from them)")
    if len({(i.zero, id(i.mesh)) for i in infos}) != 1:
        raise ValueError(f"zero_optimizer got models wrapped differently ({infos}); wrap every stage alike")
    params = [p for m in _models(models) for p in m.parameters()]
    info = infos[0]
    if info.zero != 1 or info.noop:
        return optimizer_class(params, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    experts = {id(p) for m in _models(models) for e in m.modules() if isinstance(e, ExpertsEP) for p in e.parameters()}
    if experts:  # the same only over edp: partitioned there (expert_zero.py)
        return ExpertZeroOptimizer(params, optimizer_class, info.group, info.mesh.group("edp"), experts, **defaults)
    return ZeroRedundancyOptimizer(params, optimizer_class, process_group=info.group, **defaults)


@contextlib.contextmanager
def no_sync(models: nn.Module | list[nn.Module]):
    """Accumulate gradients locally for the backwards run inside (no dp reduction): DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``. The first backward after the
    block reduces the sum of every micro-batch's gradients. Give every micro-batch's loss the
    step's count of real targets, not a 1 / micro-batches factor (with padding the micro-batches
    hold different counts): ``num_targets=model.count_targets(step_labels)`` to the forward of a
    parallelized model (or to ``lm_loss`` / a family's ``model.loss``), or transformers'
    ``num_items_in_batch=`` (this dp replica's real targets of the step, as its Trainer
    passes it). Each loss is then its share of the step's mean and the gradients simply add up
    to those of one large batch. Under FSDP2 the unsharded gradients are kept (full
    tensor-parallel piece) until that backward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    with contextlib.ExitStack() as stack:
        fsdp = []
        for model in _models(models):
            ddp = model if isinstance(model, DistributedDataParallel) else ddp_of(model)
            if ddp is not None:
                stack.enter_context(ddp.no_sync())
            elif isinstance(model, FSDPModule):
                fsdp.append(model)
        for model in fsdp:
            model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for model in fsdp:
                model.set_requires_gradient_sync(True)
