"""What a device can do, as the time and memory models need it, and measuring this host.

``calibrate()`` measures, in a few seconds, this host's matmul FLOP/s per core, its memory
bandwidth, the gloo bandwidth and per-message latency between two local ranks, and the memory a
rank process holds before any model (torch, gloo); the result is cached in
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
CACHE_VERSION = 1


@dataclass(frozen=True)
class Hardware:
    """One kind of device and how devices are connected.

    flops: dense matmul FLOP/s per device in the training dtype (per core when
    ``cores_per_node`` is set: ranks then share the node's cores); memory_bytes: device memory;
    mem_bandwidth: bytes/s of device memory; intra / inter_bandwidth: bytes/s one device sends
    inside a node / to another node; intra / inter_latency: seconds per message;
    devices_per_node; runtime_bytes: memory a rank holds before any model; flops_efficiency:
    the fraction of ``flops`` matmuls reach; source: where the numbers come from."""

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
    flops_efficiency: float = 1.0
    cores_per_node: int = 0
    source: str = ""

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


def _positive(name: str, value, path: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}: {name}={value!r} must be a positive finite number; delete the file and "
                         f"calibrate again (shardzoo plan ... --hardware calibrate --recalibrate)")
    return value


def from_json(data: dict, path: str) -> Hardware:
    """A Hardware from a cache file's contents (untrusted: every field checked)."""
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; delete it and calibrate again")
    names = {f.name for f in fields(Hardware)}
    missing = sorted(n for n in names if n not in data and n not in ("flops_efficiency", "cores_per_node", "source"))
    if missing:
        raise ValueError(f"{path} lacks {missing}; delete it and calibrate again")
    kwargs = {k: data[k] for k in names if k in data}
    for k, v in kwargs.items():
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


def _gloo_probe(small: int, large: int, reps: int) -> dict:
    """On each of 2 ranks: median all_reduce seconds of ``small`` and ``large`` bytes, and RSS."""
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

    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    return {"small": timed(small), "large": timed(large), "rss": rss}


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
    hw = Hardware("calibrate", flops=_measure_flops(), memory_bytes=_host_memory(), mem_bandwidth=_measure_mem_bandwidth(),
                  intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, intra_latency=latency, inter_latency=latency,
                  devices_per_node=1 << 20, runtime_bytes=max(r["rss"] for r in probe), cores_per_node=_cores(),
                  source=f"measured on {platform.node()} at {time.strftime('%Y-%m-%d %H:%M')}: fp32 matmul per core, "
                         f"memory copy, gloo all_reduce between 2 local ranks, rank RSS after init")
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
