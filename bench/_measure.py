"""Run a candidate layout for real and measure it: the check of the planner's predictions
(tests/planner, bench/plan.py; benchmark code, which the shardzoo package does not import).

``run_layout(spec)`` runs on every rank of a world (a WorkerPool / ``shardzoo.launch``): it
builds the model on ``ParallelMesh(**spec["layout"])`` (a shardzoo family, or with ``spec["hf"]`` a
transformers causal LM split by ``shardzoo.parallelize``: ``build_hf_model``), runs training steps as a
user would
(``data_parallel`` at ``spec["zero"]`` (default 0) + the model's loss (a transformers model's
``labels=`` loss), or a 1F1B pipeline schedule with ``sync_tied_grads`` (a transformers model:
``shardzoo.pipeline``, ``spec["schedule"]``),
then AdamW) and returns, for the last step, this rank's

* ``counted``: bytes ``shardzoo.comm.count`` counted (every shardzoo collective and p2p send);
* ``ddp``, ``p2p``, ``tied``: bytes of what torch.distributed is called for directly, each under
  the same ring model: DDP's gradient buckets (through a DDP comm hook that reports each bucket
  and then all-reduces it as DDP would) with, at ZeRO stage 1, ZeroRedundancyOptimizer's
  parameter broadcasts, torch pipelining's stage sends (``P2POp`` sends on the pp group) and the
  tied-embedding all-reduce of ``sync_tied_grads``;
* ``param_bytes`` (the stage's parameters, each tensor once), step seconds, peak RSS and the RSS
  before the build (``base_rss``: what the process held already).

With ``spec["time_on_heap"]`` (bench/plan.py, whose ranks start with ``MALLOC_MMAP_THRESHOLD_``
so that freed blocks leave the RSS and the peak follows live bytes) the peak is read after a
second step, and the timed steps then run with glibc keeping freed blocks in its heap: returning
every large tensor to the OS would fault its pages in again on each step, which costs time no
user pays under glibc's default thresholds.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from fractions import Fraction

import torch
import torch.distributed as dist

from shardzoo.comm.accounting import CommRecord
from shardzoo.planner.host_cpu import MMAP_THRESHOLD_BYTES


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> None:
    """Return freed heap to the OS (glibc keeps it otherwise), then restart the RSS high-water mark."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _ring_bytes(kind: str, n: int, p: int) -> Fraction:
    return CommRecord(kind, n, p).bytes_sent


def counting_ddp_hook(state, bucket):
    """DDP comm hook: record the bucket under the ring model, then all-reduce it as DDP does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    group, totals = state
    buf = bucket.buffer()
    totals["ddp"] += _ring_bytes("all_reduce", buf.numel() * buf.element_size(), dist.get_world_size(group))
    return allreduce_hook(group, bucket)


@contextlib.contextmanager
def count_pipeline_sends(pp_group, totals):
    """Count the sends torch pipelining makes on ``pp_group`` (its PipelineStage builds
    ``dist.P2POp(dist.isend, ...)`` at call time, so a subclass in its place sees each one)."""
    original = dist.P2POp

    class CountingP2POp(original):
        def __init__(self, op, tensor, *args, **kwargs):
            super().__init__(op, tensor, *args, **kwargs)
            if op is dist.isend and self.group is pp_group:
                totals["p2p"] += tensor.numel() * tensor.element_size()

    dist.P2POp = CountingP2POp
    try:
        yield
    finally:
        dist.P2POp = original


@contextlib.contextmanager
def count_all_reduce(totals, key, kind="all_reduce"):
    """Count the torch.distributed calls of ``kind`` (all_reduce or broadcast) made inside the
    block under ``key`` (callers pass the tensor first, as ZeroRedundancyOptimizer and
    sync_tied_grads do)."""
    original = getattr(dist, kind)

    def counting(tensor, *args, group=None, **kwargs):
        totals[key] += _ring_bytes(kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group))
        return original(tensor, *args, group=group, **kwargs)

    setattr(dist, kind, counting)
    try:
        yield
    finally:
        setattr(dist, kind, original)


def build_model(spec: dict, mesh):
    """The spec's model (family, config dict) as this rank's stage, on CPU, seeded."""
    from shardzoo.models.spec import spec_named

    fam = spec_named(spec["family"])
    stage = (mesh.pp_rank, mesh.pp_size) if mesh.pp_size > 1 else None
    return fam.model(fam.config(**spec["config"]), mesh=mesh, stage=stage, sp_mode=spec.get("sp_mode", "ring"),
                     checkpointing=spec.get("checkpointing", False), seed=spec.get("seed", 0),
                     sequence_parallel=spec.get("sequence_parallel", True))


def build_hf_model(spec: dict, mesh):
    """The transformers causal LM of ``spec["hf"]`` ({"model_type", "config": fields}), built
    in-process from its config (no hub), seeded, split by ``shardzoo.parallelize`` with its
    default plan (``spec["sp_mode"]``, ``spec["checkpointing"]``); with pp > 1 cut into stages
    (``spec["stages"]``, ``spec["virtual_stages"]``, ``spec["placement"]``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardzoo import parallelize

    config = AutoConfig.for_model(spec["hf"]["model_type"], **spec["hf"]["config"])
    torch.manual_seed(spec.get("seed", 0))
    model = AutoModelForCausalLM.from_config(config).float()
    cut = dict(stages=spec.get("stages"), virtual_stages=spec.get("virtual_stages", 1),
               placement=spec.get("placement", "loop")) if mesh.pp_size > 1 else {}
    return parallelize(model, mesh, sp_mode=spec.get("sp_mode", "ring"), checkpointing=spec.get("checkpointing", False),
                       sequence_parallel=spec.get("sequence_parallel", True), **cut)


def hf_batch(spec: dict, model, mesh) -> torch.Tensor:
    """This dp replica's rows [batch / dp, seq] of a seeded batch of token ids (whole on every
    tp and sp rank: the model's input hook splits them)."""
    gen = torch.Generator().manual_seed(spec.get("seed", 0) + 1)
    ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), generator=gen)
    return ids.chunk(mesh.dp_size, 0)[mesh.dp_rank]


def make_batch(spec: dict, model, mesh):
    """(stage inputs, stage target) of this dp replica's rows of a seeded global batch."""
    gen = torch.Generator().manual_seed(spec.get("seed", 0) + 1)
    rows, c = spec["batch"] // mesh.dp_size, model.config
    if spec["family"] == "vit":
        pixels = torch.randn(spec["batch"], c.num_channels, c.image_size, c.image_size, generator=gen)
        labels = torch.randint(0, c.num_labels, (spec["batch"],), generator=gen)
        pixels, labels = (t.chunk(mesh.dp_size, 0)[mesh.dp_rank] for t in (pixels, labels))
        return (model.shard_input(pixels) if model.is_first else None,
                model.shard_target(labels) if model.is_last else None)
    ids = torch.randint(0, c.vocab_size, (spec["batch"], spec["seq"] + 1), generator=gen)
    ids = ids.chunk(mesh.dp_size, 0)[mesh.dp_rank]
    assert ids.shape[0] == rows
    return (model.shard_input(ids[:, :-1]) if model.is_first else None,
            model.shard_target(ids[:, 1:]) if model.is_last else None)


def run_layout(spec: dict) -> dict:
    """Build, train ``spec["steps"]`` steps (the first one warms up), measure the last ones."""
    from shardzoo import comm
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads
    from shardzoo.parallel import data_parallel, ddp_of, info_of, zero_optimizer
    from shardzoo.comm.mesh_cache import cached_mesh

    if spec.get("threads"):  # intra-op threads per rank (bench/pipeline.py compares 1 rank with several)
        torch.set_num_threads(spec["threads"])
    mesh = cached_mesh(**spec["layout"])
    _reset_peak_rss()  # the peak covers building, the warm-up step (optimizer state) and the measured steps
    base_rss = _rss_kib("VmRSS") * 1024
    hf = "hf" in spec  # a transformers model split by parallelize, trained through its labels= loss
    model = build_hf_model(spec, mesh) if hf else build_model(spec, mesh)
    param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    totals = {"ddp": Fraction(0), "p2p": Fraction(0), "tied": Fraction(0)}
    zero = spec.get("zero", 0)
    wrapped = data_parallel(model, mesh, zero=zero)  # the model itself, wrapped in place
    if zero <= 1 and ddp_of(wrapped) is not None:  # DDP, at zero 1 under a ZeroRedundancyOptimizer
        # DDP's own group: dp x sp, or dp for a parallelize'd model (its backward averages over sp)
        ddp_of(wrapped).register_comm_hook((info_of(wrapped).group, totals), counting_ddp_hook)
    # FSDP2 (zero 2, 3) runs its own collectives, which neither comm.count nor the DDP hook sees
    opt = zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-4)
    if hf:
        ids = hf_batch(spec, model, mesh)
    else:
        inputs, target = make_batch(spec, model, mesh)
    schedule = pipe = None
    if hf and mesh.pp_size > 1:  # shardzoo.pipeline of the cut model
        from shardzoo import pipeline

        pipe = pipeline(wrapped, mesh, n_microbatches=spec["micro_batches"], schedule=spec.get("schedule", "1f1b"))
        for engine in pipe.engines:  # one DDP per stage view (zero 0 / 1)
            if isinstance(engine, torch.nn.parallel.DistributedDataParallel):
                engine.register_comm_hook((info_of(wrapped).group, totals), counting_ddp_hook)
        sync_tied = pipe._sync_tied

        def counted_sync_tied():  # the tied table's all-reduce, under "tied" (the step's other calls are counted)
            with count_all_reduce(totals, "tied"):
                sync_tied()

        pipe._sync_tied = counted_sync_tied
    elif mesh.pp_size > 1:
        schedule = build_schedule([(mesh.pp_rank, wrapped)], mesh, n_microbatches=spec["micro_batches"],
                                  loss_fn=model.loss)

    def step():
        opt.zero_grad(set_to_none=True)
        if pipe is not None:
            with count_pipeline_sends(mesh.pp_group, totals):
                pipe.step(input_ids=ids, labels=ids)
        elif hf:
            wrapped(input_ids=ids, labels=ids).loss.backward()
        elif schedule is None:
            model.loss(wrapped(inputs), target).backward()
        else:
            with count_pipeline_sends(mesh.pp_group, totals):
                # return_outputs=False: otherwise the last stage keeps every micro-batch's logits
                schedule.step(*((inputs,) if model.is_first else ()), return_outputs=False,
                              **({"target": target} if model.is_last else {}))
            with count_all_reduce(totals, "tied"):
                sync_tied_grads([model], mesh)
        with count_all_reduce(totals, "ddp", "broadcast"):  # zero 1: the optimizer's parameter broadcasts
            opt.step()

    model.train()
    step()  # warm-up: lazily built groups, pipeline shape inference, optimizer state
    peak_rss = None
    if spec.get("time_on_heap"):
        # the peak is taken while freed blocks leave the RSS, over a second step too: it holds
        # the optimizer state from its start, as every later one does. Then the timed steps run
        # on a heap that keeps freed blocks, as glibc settles by default, rather than faulting
        # in fresh pages for every large tensor
        step()
        peak_rss = _rss_kib("VmHWM") * 1024
        if keep_freed_heap():
            step()  # grows the heap once
    times, counted = [], None
    for _ in range(max(1, spec.get("steps", 2) - 1)):
        for k in totals:
            totals[k] = Fraction(0)
        dist.barrier()
        start = time.perf_counter()
        with comm.count() as counter:
            step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        counted = counter.total_bytes
    return {"stage": mesh.pp_rank, "param_bytes": param_bytes, "counted": counted, **totals,
            "optimizer_bytes": optimizer_state_bytes(opt), "step_s": statistics.median(times), "peak_rss": peak_rss or _rss_kib("VmHWM") * 1024, "base_rss": base_rss}


def optimizer_state_bytes(opt) -> int:
    """Bytes of the per-parameter state (AdamW's moments, not its step counts) this rank's
    optimizer holds: a ZeroRedundancyOptimizer's own shard (``opt.optim``)."""
    state = getattr(opt, "optim", opt).state
    return sum(t.numel() * t.element_size() for entry in state.values() for k, t in entry.items()
               if k != "step" and isinstance(t, torch.Tensor))


# glibc's mallopt parameters; the largest mmap threshold it accepts on 64-bit hosts is the time
# model's huge-tensor size
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX = -1, -3, MMAP_THRESHOLD_BYTES


def keep_freed_heap() -> bool:
    """Let glibc keep freed blocks up to 32 MiB in the heap from now on (what its dynamic
    thresholds settle at by default): for timing steps after a process was started with
    ``MALLOC_MMAP_THRESHOLD_`` to measure its peak. False where the C library has no mallopt."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX))


_BLOCKS = {"gpt2": "transformer.h", "opt": "model.decoder.layers", "bert": "bert.encoder.layer",
           "vit": "vit.encoder.layer"}


def saved_bytes(spec: dict) -> dict:
    """Bytes autograd keeps for backward in one training forward + loss of this rank's stage,
    by part ("embed", "block<i>", "head"): each tensor's storage counted once, parameters left out
    (the planner's activation terms, measured)."""
    from shardzoo.comm.mesh_cache import cached_mesh

    from shardzoo.parallel.activation_checkpointing import block_names

    mesh = cached_mesh(**spec["layout"])
    hf = "hf" in spec
    model = build_hf_model(spec, mesh) if hf else build_model(spec, mesh)
    model.train()
    if hf:
        ids = hf_batch(spec, model, mesh)
    else:
        inputs, target = make_batch(spec, model, mesh)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    part, seen = {"now": "embed"}, {}

    def enter(name):
        return lambda module, args: part.__setitem__("now", name)

    names = block_names(model) if hf else [f"{_BLOCKS[spec['family']]}.{n}" for n, _ in
                                           model.get_submodule(_BLOCKS[spec["family"]]).named_children()]
    for i, name in enumerate(names):
        block = model.get_submodule(name)
        block.register_forward_pre_hook(enter(f"block{i}"))
        block.register_forward_hook(lambda module, args, out: part.__setitem__("now", "head"))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (part["now"], storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss if hf else model.loss(model(inputs), target)
    out: dict = {}
    for name, n in seen.values():
        out[name] = out.get(name, 0) + n
    del loss
    return out


def tracked_memory(spec: dict) -> dict:
    """Bytes of live tensors at this rank's peak of one training step of ``spec["hf"]``'s model
    (after a warm-up step that makes the optimizer state), by kind, as torch's ``MemTracker``
    (a dispatch mode following every tensor's storage) sorts them: ``param``, ``grad``, ``opt``,
    ``buffer``, ``act`` (saved for backward), ``temp`` (transient), ``other`` and ``total``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardzoo.comm.mesh_cache import cached_mesh

    mesh = cached_mesh(**spec["layout"])
    model = build_hf_model(spec, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = hf_batch(spec, model, mesh)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with warnings.catch_warnings():
        # parallelize's hooks call modules inside other modules' hooks, which the tracker warns of
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        with tracker:
            step()
    [peak] = tracker.get_tracker_snapshot("peak").values()
    names = {"PARAM": "param", "GRAD": "grad", "OPT": "opt", "BUFFER": "buffer", "ACT": "act", "TEMP": "temp",
             "OTH": "other"}
    out = {names[k.name]: int(v) for k, v in peak.items() if k != "Total"}
    return {**out, "total": int(peak["Total"])}


def pretrained_peak(hf_dir: str, layout: dict, stages) -> dict:
    """``shardzoo.from_pretrained(hf_dir, ...)`` on this rank of ``layout`` (cut by ``stages``),
    after a first load that warms imports and groups up: the RSS the second load added at its
    peak and the bytes of the parameters this rank then holds."""
    from shardzoo import from_pretrained
    from shardzoo.comm.mesh_cache import cached_mesh

    mesh = cached_mesh(**layout)
    cut = {"stages": stages} if mesh.pp_size > 1 else {}
    del_me = from_pretrained(hf_dir, mesh, **cut)  # warm-up: imports, lazily built groups
    del del_me
    _reset_peak_rss()
    base = _rss_kib("VmRSS") * 1024
    model = from_pretrained(hf_dir, mesh, **cut)
    peak = _rss_kib("VmHWM") * 1024 - base
    held = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return {"stage": mesh.pp_rank, "peak_added": peak, "stage_bytes": held}
