"""What a device can do, as the time and memory models need it, and measuring this host.

``calibrate()`` measures this host, in under a minute (two pools of local ranks): its matmul
FLOP/s per core, its memory bandwidth (reported only: the models price elementwise work at the
elementwise bandwidths), the gloo bandwidth and per-message latency between two local ranks
(alone, and with 2 and 4 busy ranks per core, where a message waits for a core), and the memory
a rank process holds before any model (torch, gloo); the result is cached in
``$SHARDZOO_CACHE_DIR`` (default ``~/.cache/shardzoo``) as ``hardware-<host>.json`` and reused.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, fields

GIB = 1 << 30
CACHE_VERSION = 6


@dataclass(frozen=True)
class Hardware:
    """One kind of device and how devices are connected.

    flops: dense matmul FLOP/s per device in the training dtype (per core when
    ``cores_per_node`` is set: ranks then share the node's cores); memory_bytes: device memory;
    mem_bandwidth: bytes/s of device memory; intra / inter_bandwidth: bytes/s one device sends
    inside a node / to another node; intra / inter_latency: seconds per message;
    devices_per_node; runtime_bytes: memory a rank holds before any model; attention_flops:
    FLOP/s the attention kernel reaches (forward + backward); elementwise_bandwidth: bytes/s an
    elementwise kernel streams (read + write) over tensors that fit a cache;
    large_elementwise_bandwidth: the same over tensors larger than block_costs.LARGE_BYTES (0:
    as elementwise_bandwidth); huge_elementwise_bandwidth: the same over tensors of
    block_costs.HUGE_BYTES or more (0: as large_elementwise_bandwidth); flops_efficiency: the fraction of ``flops`` matmuls reach;
    source: where the numbers come from; shared_latency_2x / _4x: seconds per message on a CPU
    host whose cores each run 2 / 4 busy ranks, measured with ``shared_chunk`` seconds of
    single-core compute between messages (0: not measured, the latency is scaled by ranks /
    cores; see ``message_latency``); shared_latency_2x_long / _4x_long: the same with
    ``shared_chunk_long`` seconds between messages (0: not measured, the short figures serve
    for every chunk)."""

    name: str
    flops: float
    memory_bytes: int
    mem_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    devices_per_node: int
    runtime_bytes: int
    attention_flops: float
    elementwise_bandwidth: float
    flops_efficiency: float = 1.0
    cores_per_node: int = 0
    source: str = ""
    large_elementwise_bandwidth: float = 0.0
    shared_latency_2x: float = 0.0
    shared_latency_4x: float = 0.0
    shared_chunk: float = 0.0
    shared_latency_2x_long: float = 0.0
    shared_latency_4x_long: float = 0.0
    shared_chunk_long: float = 0.0
    huge_elementwise_bandwidth: float = 0.0

    def __post_init__(self):
        if not self.large_elementwise_bandwidth:
            object.__setattr__(self, "large_elementwise_bandwidth", self.elementwise_bandwidth)
        if not self.huge_elementwise_bandwidth:
            object.__setattr__(self, "huge_elementwise_bandwidth", self.large_elementwise_bandwidth)

    def to_json(self) -> dict:
        return asdict(self)

    def rank_share(self, ranks_on_node: int) -> float:
        """Fraction of a device's speed one rank gets: 1 on accelerators; on a CPU host the
        node's cores split between its ranks (a rank gets cores // ranks threads, at least one)."""
        if not self.cores_per_node:
            return 1.0
        if ranks_on_node >= self.cores_per_node:
            return self.cores_per_node / ranks_on_node
        return float(self.cores_per_node // ranks_on_node)

    def message_latency(self, latency: float, ranks_on_node: int, chunk: float | None = None) -> float:
        """Seconds per message of a link of ``latency`` when ``ranks_on_node`` ranks share the
        node and each rank computes ``chunk`` seconds (on a whole core) between two messages.

        With more busy ranks than cores a message waits until the receiving rank gets a core
        back, which costs far more than the link, and the wait grows with the compute the
        core's other ranks run meanwhile. In ranks per core: linear through the measured points
        (1, latency), (2, shared_latency_2x), (4, shared_latency_4x), and beyond the last one
        along its slope; in ``chunk``: linear between the figures measured at ``shared_chunk``
        and at ``shared_chunk_long`` (the ``_long`` points), held at the nearer one outside.
        Unmeasured points: latency * ranks / cores."""
        if not self.cores_per_node or ranks_on_node <= self.cores_per_node:
            return latency
        x = ranks_on_node / self.cores_per_node
        if not (self.shared_latency_2x and self.shared_latency_4x):
            return latency * x
        short = _along_ranks(x, latency, self.shared_latency_2x, self.shared_latency_4x)
        long_measured = self.shared_latency_2x_long and self.shared_latency_4x_long
        if chunk is None or not long_measured or self.shared_chunk_long <= self.shared_chunk:
            return short
        long = _along_ranks(x, latency, self.shared_latency_2x_long, self.shared_latency_4x_long)
        f = min(1.0, max(0.0, (chunk - self.shared_chunk) / (self.shared_chunk_long - self.shared_chunk)))
        return short + f * (long - short)


def _along_ranks(x: float, latency: float, at_2x: float, at_4x: float) -> float:
    """Seconds per message at ``x`` ranks per core through (1, latency), (2, at_2x), (4, at_4x)."""
    if x <= 2:
        return latency + (x - 1) * (at_2x - latency)
    return max(latency, at_2x + (x - 2) * (at_4x - at_2x) / 2)


def _positive(name: str, value, path: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}: {name}={value!r} must be a positive finite number; delete the file and "
                         f"calibrate again (shardzoo plan ... --hardware calibrate --recalibrate)")
    return value


SHARED = ("shared_latency_2x", "shared_latency_4x", "shared_chunk", "shared_latency_2x_long",
          "shared_latency_4x_long", "shared_chunk_long")
OPTIONAL = ("flops_efficiency", "cores_per_node", "source", "large_elementwise_bandwidth",
            "huge_elementwise_bandwidth") + SHARED


def from_json(data: dict, path: str) -> Hardware:
    """A Hardware from a cache file's contents (untrusted: every field checked)."""
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; delete it and calibrate again")
    names = {f.name for f in fields(Hardware)}
    missing = sorted(n for n in names if n not in data and n not in OPTIONAL)
    if missing:
        raise ValueError(f"{path} lacks {missing}; delete it and calibrate again")
    kwargs = {k: data[k] for k in names if k in data}
    for k, v in kwargs.items():
        if k in SHARED and v == 0 and not isinstance(v, bool):
            continue  # 0: not measured
        if k not in ("name", "source", "cores_per_node"):
            _positive(k, v, path)
    for k in ("memory_bytes", "devices_per_node", "runtime_bytes"):
        kwargs[k] = int(kwargs[k])
    if not isinstance(kwargs.get("cores_per_node", 0), int) or kwargs.get("cores_per_node", 0) < 0:
        raise ValueError(f"{path}: cores_per_node={kwargs['cores_per_node']!r} must be a non-negative integer")
    return Hardware(**kwargs)


def cache_path() -> str:
    root = os.environ.get("SHARDZOO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shardzoo")
    return os.path.join(root, f"hardware-{platform.node() or 'host'}.json")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _measure_flops(seconds: float = 0.5, n: int = 512) -> float:
    """Single-thread fp32 matmul FLOP/s (ranks of a busy host run one thread each)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            reps += 1
        return 2 * n**3 * reps / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def _single_thread(fn):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _measure_norm_bandwidth(reps: int = 9) -> float:
    """Bytes/s of elementwise work over cache-sized tensors as the planner counts it: a LayerNorm
    forward + backward of [256, 256] fp32 is NORM_PASSES passes of 8 bytes per element."""
    import torch

    from shardzoo.layers.block_costs import NORM_PASSES

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

    from shardzoo.layers.cross_entropy import vocab_parallel_cross_entropy
    from shardzoo.layers.block_costs import LOSS_PASSES

    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    logits = torch.randn(rows, 8192, requires_grad=True)
    target = torch.randint(0, 8192, (rows,))

    def run():
        vocab_parallel_cross_entropy(logits, target, group=own, vocab_start=0, vocab_size=8192).backward()

    return LOSS_PASSES * logits.numel() * 8 / _median_seconds(run, reps)


def _median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure_attention(reps: int = 3) -> float:
    """FLOP/s of shardzoo's attention block kernel, forward + backward, one thread."""
    import torch

    from shardzoo.kernels import flash_attention

    def run():
        q, k, v = (torch.randn(1, 4, 512, 64, requires_grad=True) for _ in range(3))
        flash_attention(q, k, v).sum().backward()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            flash_attention(q, k, v).sum().backward()
            times.append(time.perf_counter() - start)
        return 3 * 4 * 4 * 512 * 512 * 64 / statistics.median(times)

    return _single_thread(run)


def _measure_mem_bandwidth(n_bytes: int = 64 << 20) -> float:
    import torch

    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * n_bytes / statistics.median(times)  # read + write


def _runtime_rss() -> int:
    """RSS of a rank that has trained a tiny model (dp=2, DDP, AdamW): torch, gloo, shardzoo's
    code and the allocator's arenas, before any real model."""
    import torch

    from shardzoo.planner.measure import run_layout

    run_layout(dict(family="gpt2", config=dict(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8),
                    layout=dict(dp=2, pp=1, sp=1, tp=1, tp_mode="1d", tp_depth=1), micro_batches=1, batch=2, seq=4,
                    steps=2))
    torch.distributed.barrier()
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)


def _gloo_probe(small: int, large: int, reps: int) -> dict:
    """On each of 2 ranks: median all_reduce seconds of ``small`` and ``large`` bytes, and the
    runtime RSS."""
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

    out = {"small": timed(small), "large": timed(large), "rss": _runtime_rss()}
    # compute rates with every rank busy at once, one thread each, as training ranks run
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
    """Hardware's shared_* fields: seconds per message with 2 and with 4 ranks per core, each
    after a short and after a long matmul (``shared_chunk`` / ``shared_chunk_long``: its seconds
    on one core), pinned to ``SHARED_CORES`` cores: an all_reduce between 2 ranks is 2 messages."""
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


def calibrate(use_cache: bool = True) -> Hardware:
    """This host as a Hardware (cached; ``use_cache=False`` measures again)."""
    path = cache_path()
    if use_cache and os.path.isfile(path):
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON ({err}); delete it and calibrate again") from None
        if isinstance(data, dict) and data.get("version") == CACHE_VERSION:
            return from_json(data.get("hardware"), path)
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

    hw = Hardware("calibrate", flops=rate("flops"), memory_bytes=_host_memory(), mem_bandwidth=_measure_mem_bandwidth(),
                  intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, intra_latency=latency, inter_latency=latency,
                  devices_per_node=1 << 20, runtime_bytes=max(r["rss"] for r in probe),
                  attention_flops=rate("attention"), elementwise_bandwidth=rate("elementwise"),
                  large_elementwise_bandwidth=rate("large_elementwise"), cores_per_node=_cores(),
                  huge_elementwise_bandwidth=rate("huge_elementwise"),
                  **shared,
                  source=f"measured on {platform.node()} at {time.strftime('%Y-%m-%d %H:%M')}: on 2 local ranks at "
                         f"once, one thread each, fp32 matmul, attention, LayerNorm (small tensors) and cross entropy "
                         f"(8 and 32 MiB of logits) per core; gloo all_reduce between the 2 ranks, alone and with 2 and 4 busy "
                         f"ranks per core after short and long matmuls; rank RSS after a tiny training step; memory copy")
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
