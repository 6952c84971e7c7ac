"""Measuring this host for the ``cpu`` / ``calibrate`` presets (``shardzoo plan --hardware
calibrate``), in under a minute on two pools of local ranks.

``calibrate()`` measures the device figures of a :class:`~shardzoo.planner.hardware.Hardware`:
matmul FLOP/s per core, the attention kernel's FLOP/s, the elementwise bandwidth over
cache-sized tensors, the gloo bandwidth and per-message latency between two local ranks, the
memory a rank process holds before any model (torch, gloo) and the memory bandwidth (reported
only); and those of its host model, :class:`~shardzoo.planner.host_cpu.TimeSharedCpu`: the
elementwise bandwidths over large and huge tensors, the fixed cost of a module call (forward
and backward of a tiny model's training step, per module call) and the latency of a message
with 2 and 4 busy ranks per core, where it waits for a core. The result is cached in
``$SHARDZOO_CACHE_DIR`` (default ``~/.cache/shardzoo``) as ``hardware-<host>.json`` and reused.

The measuring here is the least the planner needs at run time: the rank's runtime memory and
the fixed cost of a module call come from a few tiny training steps (:func:`_tiny_training`).
Checking the planner's predictions against real runs is benchmark code (bench/_measure.py,
bench/plan.py).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

from shardzoo.planner.hardware import GIB, Hardware, from_flat_json, from_json
from shardzoo.planner.host_cpu import TimeSharedCpu

CACHE_VERSION = 8  # 8: library_bytes; 7: the host model's fields under "host"; 6: the same fields flat
FLAT_VERSION = 6


def cache_path() -> str:
    root = os.environ.get("SHARDZOO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shardzoo")
    return os.path.join(root, f"hardware-{platform.node() or 'host'}.json")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _single_thread(fn):
    """``fn()`` on one intra-op thread, as each rank of a busy host runs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure_flops(seconds: float = 0.5, n: int = 512) -> float:
    """fp32 matmul FLOP/s on the calling thread."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _measure_norm_bandwidth(reps: int = 9) -> float:
    """Bytes/s of elementwise work over cache-sized tensors as the planner counts it: a LayerNorm
    forward + backward of [256, 256] fp32 is NORM_PASSES passes of 8 bytes per element."""
    import torch

    from shardzoo.planner.block_costs import NORM_PASSES

    x = torch.randn(256, 256, requires_grad=True)
    norm = torch.nn.LayerNorm(256)
    return NORM_PASSES * x.numel() * 8 / _median_seconds(lambda: norm(x).sum().backward(), reps)


def _measure_loss_bandwidth(rows: int = 256, reps: int = 5) -> float:
    """The same over large tensors: shardzoo's cross entropy forward + backward of [rows, 8192]
    fp32 logits is LOSS_PASSES passes (on a group of one rank: no communication). 256 rows are
    8 MiB, a large tensor that glibc's heap keeps; 1024 rows are 32 MiB, a huge one that each
    step maps afresh."""
    import torch
    import torch.distributed as dist

    from shardzoo.planner.block_costs import LOSS_PASSES
    from shardzoo.layers.cross_entropy import vocab_parallel_cross_entropy

    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    logits = torch.randn(rows, 8192, requires_grad=True)
    target = torch.randint(0, 8192, (rows,))

    def run():
        vocab_parallel_cross_entropy(logits, target, group=own, vocab_start=0, vocab_size=8192).backward()

    return LOSS_PASSES * logits.numel() * 8 / _median_seconds(run, reps)


def _measure_attention(reps: int = 3) -> float:
    """FLOP/s of shardzoo's attention block kernel, forward + backward."""
    import torch

    from shardzoo.kernels import flash_attention

    q, k, v = (torch.randn(1, 4, 512, 64, requires_grad=True) for _ in range(3))
    return 3 * 4 * 4 * 512 * 512 * 64 / _median_seconds(lambda: flash_attention(q, k, v).sum().backward(), reps)


def _measure_mem_bandwidth(n_bytes: int = 64 << 20) -> float:
    import torch

    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _median_seconds(lambda: dst.copy_(src), 5)  # read + write


def _tiny_training(steps: int = 9) -> tuple[int, float]:
    """(RSS, seconds per module call) of a rank training a tiny model of a causal LM family
    (dp=2, DDP, AdamW): the RSS after it holds torch, gloo, shardzoo's code and the allocator's
    arenas, before any real model; a forward and backward there costs nothing but the calls
    themselves (Python, dispatch, autograd, the hooks of the engines), so its median time over
    the module calls of its forward is the fixed cost of one call."""
    import torch

    from shardzoo.comm.mesh_cache import cached_mesh
    from shardzoo.models.spec import all_specs
    from shardzoo.parallel import data_parallel, zero_optimizer

    mesh = cached_mesh(dp=2, pp=1, sp=1, tp=1, tp_mode="1d", tp_depth=1)
    fam = next(s for s in all_specs() if s.model.causal)  # a causal LM family (every parameter used)
    config = fam.config(**fam.tiny_config(layers=1, vocab=16, ffn=32, hidden=8, heads=2))
    model = fam.model(config, mesh=mesh, seed=0)
    wrapped = data_parallel(model, mesh, zero=0)
    optimizer = zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(mesh.dp_rank))
    calls = []
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in leaves]
    times = []
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model.loss(wrapped(model.shard_input(ids[:, :-1])), model.shard_target(ids[:, 1:])).backward()
        times.append(time.perf_counter() - start)
        optimizer.step()
        if i == 0:
            for h in handles:
                h.remove()
    torch.distributed.barrier()
    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    return rss, statistics.median(times[1:]) / len(calls)


def _transformers_bytes() -> int:
    """The RSS a rank adds when it builds a tiny transformers causal LM and trains it two steps
    (transformers' modules, loaded as its first model is built), after :func:`_tiny_training`;
    0 without transformers."""
    try:
        import transformers
    except ImportError:
        return 0
    import torch

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)

    before = rss()
    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=16, max_position_embeddings=8)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    return max(rss() - before, 0)


def _gloo_probe(small: int, large: int, reps: int) -> dict:
    """On each of 2 ranks: median all_reduce seconds of ``small`` and ``large`` bytes, the
    runtime RSS, and the compute rates with every rank busy at once, one thread each, as
    training ranks run."""
    import torch
    import torch.distributed as dist

    def timed(n):
        x = torch.zeros(n // 4)
        dist.all_reduce(x)
        out = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            out.append(time.perf_counter() - start)
        return statistics.median(out)

    out = {"small": timed(small), "large": timed(large)}
    out["rss"], out["module_call"] = _single_thread(_tiny_training)
    out["library"] = _transformers_bytes()
    for key, measure in (("flops", _measure_flops), ("attention", _measure_attention),
                         ("elementwise", _measure_norm_bandwidth), ("large_elementwise", _measure_loss_bandwidth),
                         ("huge_elementwise", lambda: _measure_loss_bandwidth(1024))):
        dist.barrier()
        out[key] = _single_thread(measure)
    return out


SHARED_CORES = 2  # cores the shared-latency probe pins its ranks to (fewer if the host has fewer)
# the matmuls between its messages: [512, 512] is a few ms on one core, [1024, 1024] eight times
# that, the span of the compute a training rank of a small model does between two messages (the
# wait for a core grows with it)
SHARED_MATMUL, SHARED_MATMUL_LONG = 512, 1024


def _shared_latency_probe(iters: int, n: int) -> dict:
    """On each of 4 * c ranks pinned to the same c cores: seconds per small all_reduce between
    rank pairs, beyond the compute in between, with 2 * c and then all 4 * c ranks busy (an
    [n, n] matmul between messages, as training ranks compute between collectives)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cores = world // 4
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    torch.set_num_threads(1)
    a, x = torch.randn(n, n), torch.zeros(1)

    def loop(talk: bool) -> float:
        start = time.perf_counter()
        for _ in range(iters):
            a @ a
            if talk:
                dist.all_reduce(x, group=pairs[rank // 2])
        return time.perf_counter() - start

    out = {}
    for busy in (2 * cores, 4 * cores):
        dist.barrier()
        if rank < busy:  # the others wait in the barrier, off the cores
            loop(True)
            quiet, talking = zip(*[(loop(False), loop(True)) for _ in range(3)])
            out[busy] = (statistics.median(quiet), statistics.median(talking))
        dist.barrier()
    return out


def _shared_latency() -> dict:
    """TimeSharedCpu's shared_* fields: seconds per message with 2 and with 4 ranks per core,
    each after a short and after a long matmul (``shared_chunk`` / ``shared_chunk_long``: its
    seconds on one core), pinned to ``SHARED_CORES`` cores: an all_reduce between 2 ranks is 2
    messages."""
    from shardzoo.comm.workers import WorkerPool

    cores = max(1, min(SHARED_CORES, _cores()))
    out = {}
    with WorkerPool(4 * cores, timeout=300) as pool:
        for suffix, n, iters in (("", SHARED_MATMUL, 30), ("_long", SHARED_MATMUL_LONG, 8)):
            got = pool.run(_shared_latency_probe, iters, n)
            for per_core, busy in ((2, 2 * cores), (4, 4 * cores)):
                quiet = max(r[busy][0] for r in got[:busy])
                talking = max(r[busy][1] for r in got[:busy])
                out[f"shared_latency_{per_core}x{suffix}"] = max(talking - quiet, 1e-9) / iters / 2
            # the quiet loop of 2 ranks per core: each matmul on a whole core is half its share
            out[f"shared_chunk{suffix}"] = max(r[2 * cores][0] for r in got[:2 * cores]) / iters / 2
    return out


def load_cached(path: str) -> Hardware | None:
    """The Hardware a cache file holds; None when it is of another version (measure again)."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); delete it and calibrate again") from None
    version = data.get("version") if isinstance(data, dict) else None
    if version == CACHE_VERSION:
        return from_json(data.get("hardware"), path)
    if version == FLAT_VERSION:
        return from_flat_json(data.get("hardware"), path)
    return None


def calibrate(use_cache: bool = True) -> Hardware:
    """This host as a Hardware with a TimeSharedCpu host model (cached; ``use_cache=False``
    measures again)."""
    path = cache_path()
    if use_cache and os.path.isfile(path):
        cached = load_cached(path)
        if cached is not None:
            return cached
    from shardzoo.comm.workers import WorkerPool

    small, large = 4, 16 << 20
    with WorkerPool(2, timeout=120) as pool:
        probe = pool.run(_gloo_probe, small, large, 7)
    t_small = max(r["small"] for r in probe)
    t_large = max(r["large"] for r in probe)
    latency = t_small / 2  # an all_reduce on 2 ranks is 2 messages
    bandwidth = large / max(t_large - t_small, 1e-9)  # AR(2, n) sends n bytes

    def rate(key):
        return statistics.fmean(r[key] for r in probe)

    shared = _shared_latency()
    shared.update({k: max(v, latency) for k, v in shared.items() if k.startswith("shared_latency")})
    host = TimeSharedCpu(cores=_cores(), large_elementwise_bandwidth=rate("large_elementwise"),
                         huge_elementwise_bandwidth=rate("huge_elementwise"),
                         module_call_seconds=rate("module_call"), **shared)
    hw = Hardware("calibrate", flops=rate("flops"), memory_bytes=_host_memory(), mem_bandwidth=_measure_mem_bandwidth(),
                  intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, intra_latency=latency, inter_latency=latency,
                  devices_per_node=1 << 20, runtime_bytes=max(r["rss"] for r in probe),
                  library_bytes=max(r["library"] for r in probe),
                  attention_flops=rate("attention"), elementwise_bandwidth=rate("elementwise"), backend="gloo", host=host,
                  source=f"measured on {platform.node()} at {time.strftime('%Y-%m-%d %H:%M')}: on 2 local ranks at "
                         f"once, one thread each, fp32 matmul, attention, LayerNorm (small tensors) and cross entropy "
                         f"(8 and 32 MiB of logits) per core, a module call of a tiny model's training step; gloo "
                         f"all_reduce between the 2 ranks, alone and with 2 and 4 busy ranks per core after short and "
                         f"long matmuls; rank RSS after a few tiny training steps, and what a tiny transformers model's "
                         f"build and steps add to it; memory copy")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": CACHE_VERSION, "hardware": hw.to_json()}, f, indent=2)
    os.replace(tmp, path)
    return hw


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB
