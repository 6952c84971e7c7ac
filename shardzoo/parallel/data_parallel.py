"""``data_parallel(model, mesh, zero=...)``: the dp axis of a shardzoo model through torch.

Every rank's loss is the mean over its own tokens, so the gradient of the global mean is the
average of the ranks' gradients over dp and sp (sp ranks hold other tokens of the same rows);
every stage averages over that group, ``mesh.group("dp", "sp")``, except that DDP (zero 0 / 1)
of a model made by ``shardzoo.parallelize``, whose ``backward()`` averages over sp itself
(parallel/sp_grads.py), averages over dp only:

====== ============================================= ==========================================
zero   engine                                        sharded over the dp (x sp) group
====== ============================================= ==========================================
0      DDP (held by the model, see ddp_of)           nothing
1      DDP + ZeroRedundancyOptimizer (zero_optimizer) optimizer state (whole parameters)
2      FSDP2 fully_shard, reshard_after_forward=False optimizer state, gradients; parameters
                                                      between steps (whole through fwd / bwd)
3      FSDP2 fully_shard per block, then the root     optimizer state, gradients, parameters
====== ============================================= ==========================================

Every stage returns the model itself, wrapped in place: the same object, class, parameter
names and methods (``model.loss``, ``model.shard_input``), whose calls now run the engine.

With expert parallelism (``ParallelMesh(ep=E)``) the experts' parameters (layers/experts.py)
are different on the ranks of an ep group, so they stay out of the dp x sp engine: their
gradients are averaged over the expert data parallel group edp by their own layer (zero 0 /
1; for zero 1 ``zero_optimizer`` partitions their optimizer state over edp, the rest over dp
(x sp): parallel/expert_zero.py), or FSDP2 shards them over edp as their own units (zero 2 /
3). Every stage composes with ep.

The tensor-parallel parameters are plain local tensors, so FSDP2 shards each rank's piece
along its dim 0 over the dp axes; the ShardSpec on the owning module still describes the
piece (layers/dp_shard.py gives the rows this rank keeps). See docs/data_parallel.md.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.layers.experts import ExpertsEP
from shardzoo.parallel import pipeline_cut, sp_grads

_MARK = "_shardzoo_data_parallel"  # module attribute: the DataParallelInfo of a wrapped model
_DDP = "_shardzoo_ddp"  # instance dict entry: the DDP engine of a zero 0 / 1 model (not a submodule)
MIXED_PRECISION = {"bf16": torch.bfloat16}


class DataParallelInfo:
    """What :func:`data_parallel` did to a model: ``zero``, the ``mesh``, the mesh ``axes``
    it averages (and, for zero >= 1, shards) over, and whether that group had one rank
    (``noop``: the model was returned unchanged)."""

    def __init__(self, zero: int, mesh, axes: tuple[str, ...], noop: bool):
        self.zero, self.mesh, self.axes, self.noop = zero, mesh, axes, noop

    @property
    def group(self):
        return self.mesh.group(*self.axes)

    def __repr__(self) -> str:
        return f"DataParallelInfo(zero={self.zero}, axes={self.axes}, noop={self.noop})"


def info_of(model: nn.Module) -> DataParallelInfo | None:
    """The :class:`DataParallelInfo` of a model passed through :func:`data_parallel`, else None."""
    return getattr(model, _MARK, None)


def ddp_of(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The torch DDP engine that a zero 0 / 1 model's calls run through (for DDP's own API:
    ``no_sync``, ``join``, communication hooks), else None. It is not a submodule of the model
    (names, ``state_dict`` and checkpoints stay the model's own)."""
    return model.__dict__.get(_DDP)


class _OwnForward(nn.Module):
    """The module DDP wraps: it runs the model's own forward (its class's, or one set on the
    instance before wrapping), so the model's calls can go through DDP while the model stays
    the object the user holds.

    ``model(...)`` runs the model's hooks, then the DDP, then this. A pipeline stage calls the
    DDP engine itself (torch's stages recognise DDP), which would skip the model's hooks (the
    SDPA mode and mask hooks of a parallelized model or stage), so a call that did not come
    through ``model(...)`` goes round it once: ``model(...)`` with the own forward in place."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.own = model.__dict__.get("forward")  # replaced next by the DDP
        self.calls = 0  # model(...) calls in flight (their hooks have run)
        model.register_forward_pre_hook(self._enter, prepend=True)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module, args) -> None:
        self.calls += 1

    def _leave(self, module, args, output) -> None:
        self.calls -= 1

    def own_forward(self, *args, **kwargs):
        if self.own is not None:
            return self.own(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if self.calls > 0:
            return self.own_forward(*args, **kwargs)
        engine = self.model.__dict__["forward"]
        self.model.__dict__["forward"] = self.own_forward  # the hooks run, then the own forward
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.__dict__["forward"] = engine


def _ddp_in_place(model: nn.Module, info: DataParallelInfo) -> nn.Module:
    """Wrap ``model`` in torch DDP over ``info``'s group (dp x sp, or dp where backward()
    averages over sp already) and route ``model(...)`` through it."""
    from torch.nn.parallel import DistributedDataParallel

    # a stage's microbatches all run backward before the reduction; DDP's bucket rebuild after
    # the first step counts every microbatch's hooks and fails, which find_unused_parameters skips
    wrapped = _OwnForward(model)
    experts = [f"model.{name}.{leaf}" for name, m in model.named_modules() if isinstance(m, ExpertsEP)
               for leaf, _ in m.named_parameters()]
    if experts:  # averaged over edp by their layer, not over dp (x sp)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapped, experts)
    ddp = DistributedDataParallel(wrapped, process_group=info.group,
                                  find_unused_parameters=info.mesh.pp_size > 1)
    # kept outside _modules: registering DDP (which holds the model) would make a cycle of submodules
    model.__dict__[_DDP] = ddp
    model.__dict__["forward"] = ddp  # nn.Module.__call__ runs the model's hooks, then this
    return model


def _check_args(model, mesh, zero, mixed_precision, offload, reshard_after_forward) -> None:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(zero, bool) or not isinstance(zero, int) or not 0 <= zero <= 3:
        raise ValueError(f"zero={zero!r} is not a ZeRO stage; use 0 (DDP), 1 (+ optimizer state sharded), 2 (+ "
                         f"gradients) or 3 (+ parameters)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"data_parallel needs an nn.Module (a model or a pipeline stage); got {type(model).__name__}")
    done = info_of(model)
    fsdp = [n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if done is not None or isinstance(model, nn.parallel.DistributedDataParallel) or fsdp:
        how = repr(done) if done is not None else ("FSDP2 on " + ", ".join(fsdp[:3]) if fsdp else "DDP")
        raise ValueError(f"the model is already wrapped for data parallelism ({how}); call data_parallel once, on "
                         f"the unwrapped model (build a fresh model to change the ZeRO stage)")
    for name in ("dp", "sp"):
        if name not in getattr(mesh, "axis_names", ()):
            raise TypeError(f"data_parallel needs the ParallelMesh the model was built on; got {type(mesh).__name__}")
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use one of "
                         f"{sorted(MIXED_PRECISION)} (FSDP2 MixedPrecisionPolicy) or None (fp32)")
    fsdp_only = {"mixed_precision": mixed_precision is not None, "offload": bool(offload),
                 "reshard_after_forward": reshard_after_forward is not None and zero < 2}
    for option, used in fsdp_only.items():
        if used and zero < 2:
            raise ValueError(f"{option} is an FSDP2 option and needs zero=2 or zero=3; got zero={zero} (DDP). For "
                             f"bf16 under DDP use shardzoo.models.training.autocast()")
    if zero == 2 and reshard_after_forward not in (None, False):
        raise ValueError(f"zero=2 keeps parameters unsharded from forward to backward (reshard_after_forward=False); "
                         f"got reshard_after_forward={reshard_after_forward!r}. Use zero=3 to reshard after forward")
    if offload and dist.get_backend() != "nccl":
        raise ValueError(f"offload=True moves sharded parameters, gradients and optimizer state from the GPU to CPU "
                         f"memory, but this run computes on CPU already (backend {dist.get_backend()!r}); there is no "
                         f"device to offload from. Drop offload=True, or run on GPUs with NCCL")


def _check_experts(model: nn.Module, mesh, zero: int, units) -> None:
    """Refuse what expert parallelism does not compose with, before anything is wrapped."""
    if not any(isinstance(m, ExpertsEP) for m in model.modules()):
        return
    if zero >= 2 and units is not None:
        raise ValueError(f"units= with ep={mesh.ep_size}: the experts are FSDP2 units of their own over edp; leave "
                         f"units out")


def _shared_elsewhere(module: nn.Module, counts: collections.Counter) -> bool:
    """True when a parameter of ``module`` is also registered outside it (weight tying)."""
    inside = collections.Counter(id(p) for m in module.modules() for p in m._parameters.values() if p is not None)
    return any(counts[k] != n for k, n in inside.items())


def block_units(model: nn.Module) -> list[nn.Module]:
    """The modules zero=2/3 shard as their own FSDP2 units: every item of an ``nn.ModuleList``
    / ``nn.ModuleDict`` (the transformer blocks of shardzoo's models, ``model.layers`` of a
    custom one) that holds parameters shared with no module outside it; the outermost such
    items, in model order."""
    counts = collections.Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and any(True for _ in child.parameters()) \
                    and not _shared_elsewhere(child, counts):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def _fully_shard(model, info, zero, mixed_precision, offload, reshard_after_forward, units):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"mesh": info.mesh.sub_mesh(*info.axes)}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=MIXED_PRECISION[mixed_precision],
                                                   reduce_dtype=torch.float32)
    kwargs["offload_policy"] = CPUOffloadPolicy() if offload else OffloadPolicy()
    size = info.mesh.size(*info.axes)
    if not isinstance(reshard_after_forward, (bool, type(None))) and not (
            isinstance(reshard_after_forward, int) and 1 < reshard_after_forward < size and size % reshard_after_forward == 0):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be True, False or a divisor of the "
                         f"{size} ranks of {'x'.join(info.axes)} other than 1 and {size} (the group resharded to)")
    units = block_units(model) if units is None else list(units)
    block = False if zero == 2 else (True if reshard_after_forward is None else reshard_after_forward)
    experts = [m for m in model.modules() if isinstance(m, ExpertsEP)]
    for module in experts:  # their own units over edp, before the blocks holding them
        fully_shard(module, reshard_after_forward=block, **{**kwargs, "mesh": info.mesh.sub_mesh("edp")})
        module.reduced_by_fsdp = True
    # the root's embeddings and head are the first used in backward: FSDP2's default keeps them
    root = False if zero == 2 else reshard_after_forward
    for unit in units:
        fully_shard(unit, reshard_after_forward=block, **kwargs)
    fully_shard(model, reshard_after_forward=root, **kwargs)
    return model


def data_parallel(model: nn.Module, mesh, zero: int = 0, *, mixed_precision: str | None = None,
                  offload: bool = False, reshard_after_forward: bool | int | None = None,
                  units: list[nn.Module] | None = None) -> nn.Module:
    """Data parallelism (and ZeRO stage ``zero``) over ``mesh``'s dp axis, sp too where sp > 1.

    Args:
        model: a shardzoo model, a pipeline stage, or any module made of shardzoo layers on
            ``mesh`` (not yet wrapped). mesh: its ParallelMesh.
        zero: 0 DDP; 1 DDP, build the optimizer with :func:`shardzoo.zero_optimizer`
            (ZeroRedundancyOptimizer); 2 FSDP2 without resharding after forward; 3 FSDP2 per
            block, then the root. Each composes with expert parallelism (``ParallelMesh(ep=)``):
            the experts are averaged, and sharded for zero >= 1, over the edp group.
        mixed_precision: "bf16" (zero >= 2): FSDP2 computes in bf16 and keeps fp32 master
            weights, optimizer state and gradient reduction.
        offload: (zero >= 2, GPUs) FSDP2's CPUOffloadPolicy: sharded parameters, gradients and
            optimizer state live in CPU memory.
        reshard_after_forward: zero=3 only: True (default for blocks; the root keeps FSDP2's
            default, False), False, or an int (reshard to that many ranks); given, it applies to
            blocks and root.
        units: (zero >= 2) the submodules to shard as their own FSDP2 units; default
            :func:`block_units`.

    Returns:
        ``model`` itself, for every stage, wrapped in place: the same class, parameter names,
        ``state_dict`` and methods (``model.loss``, ``model.shard_input``); calling it runs
        the engine (zero 0 / 1: torch DDP, reachable as :func:`ddp_of`; zero 2 / 3: FSDP2,
        which makes the model an ``FSDPModule``). When the dp (x sp) group has one rank there
        is nothing to average or shard: ``model`` is returned unchanged (and marked, so a
        second call is refused like any double wrapping).
    """
    _check_args(model, mesh, zero, mixed_precision, offload, reshard_after_forward)
    _check_experts(model, mesh, zero, units)
    # a parallelized model's backward() averages over sp already: DDP adds dp only (FSDP2
    # still shards over dp x sp, where averaging the equal sp gradients again changes nothing)
    done = () if zero >= 2 else getattr(model.__dict__.get("_shardzoo_parallel"), "grads_averaged_over", ())
    axes = tuple(a for a in ("dp", "sp") if mesh.size(a) > 1 and a not in done)
    info = DataParallelInfo(zero, mesh, axes or ("dp",), noop=not axes)
    if info.noop:
        setattr(model, _MARK, info)
        return model
    if zero >= 2:
        model.__dict__[sp_grads.FSDP_AVERAGES_SP] = True  # no sp hooks: FSDP2 averages over dp x sp
        model = _fully_shard(model, info, zero, mixed_precision, offload, reshard_after_forward, units)
        setattr(model, _MARK, info)
        return model
    setattr(model, _MARK, info)
    if model.__dict__.get(pipeline_cut.CUT) is not None:
        return model  # cut into pipeline stages: shardzoo.pipeline builds one DDP per stage (pipelined.py)
    return _ddp_in_place(model, info)
