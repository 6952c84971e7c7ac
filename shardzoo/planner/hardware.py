"""What a device can do and how devices are connected, as the time and memory models need it.

A :class:`Hardware` holds what every device has; what the machine around the devices adds (ranks
time-sharing a CPU host's cores, say) is its host model, ``Hardware.host`` (planner/host.py).
Measuring this host is planner/calibration.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from shardzoo.planner.host import DEDICATED, DedicatedDevices
from shardzoo.planner.host_cpu import SHARED, TimeSharedCpu, time_shared_cpu_from_json

GIB = 1 << 30
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Hardware:
    """One kind of device and how devices are connected.

    flops: dense matmul FLOP/s per device in the training dtype; memory_bytes: device memory;
    mem_bandwidth: bytes/s of device memory; intra / inter_bandwidth: bytes/s one device sends
    inside a node / to another node; intra / inter_latency: seconds per message;
    devices_per_node; runtime_bytes: memory a rank holds before any model; library_bytes: what
    a model run by transformers' own code adds to it (the library's modules, loaded as the first
    model is built: host memory, so 0 on the accelerator presets); attention_flops:
    FLOP/s the attention kernel reaches (forward + backward); elementwise_bandwidth: bytes/s an
    elementwise kernel streams (read + write); flops_efficiency: the fraction of ``flops``
    matmuls reach; source: where the numbers come from; backend: the collective library
    ("nccl" or "gloo"), whose algorithms set the messages a call waits for; host: the host
    model (``host.DEDICATED``: none)."""

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
    library_bytes: int = 0
    source: str = ""
    backend: str = "nccl"
    host: DedicatedDevices = DEDICATED

    def runtime_for(self, transformers: bool) -> int:
        """Bytes a rank holds before a model's own: with ``transformers``, a model run by
        transformers' code, the library's too."""
        return self.runtime_bytes + (self.library_bytes if transformers else 0)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["host"] = self.host.to_json()
        return out


def _positive(name: str, value, path: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{path}: {name}={value!r} must be a positive finite number; delete the file and "
                         f"calibrate again (shardzoo plan ... --hardware calibrate --recalibrate)")
    return value


OPTIONAL = ("flops_efficiency", "library_bytes", "source", "backend", "host")
TEXT = ("name", "source", "backend", "host")


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
        if k not in TEXT and not (k == "library_bytes" and v == 0):
            _positive(k, v, path)
    for k in ("memory_bytes", "devices_per_node", "runtime_bytes", "library_bytes"):
        kwargs[k] = int(kwargs[k])
    if kwargs.get("backend", "nccl") not in BACKENDS:
        raise ValueError(f"{path}: backend={kwargs['backend']!r} is not one of {BACKENDS}")
    kwargs["host"] = host_from_json(data.get("host", {"kind": DEDICATED.kind}), path)
    return Hardware(**kwargs)


def host_from_json(data, path: str) -> DedicatedDevices:
    """The host model a Hardware's JSON names under ``host``."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == DEDICATED.kind:
        return DEDICATED
    if kind == TimeSharedCpu.kind:
        return time_shared_cpu_from_json(data, path, _positive)
    raise ValueError(f"{path}: host={data!r} names no host model ({DEDICATED.kind!r} or {TimeSharedCpu.kind!r}); "
                     f"delete the file and calibrate again")


def from_flat_json(data: dict, path: str) -> Hardware:
    """A Hardware from the flat JSON of calibration caches up to version 6, where the
    time-shared host's fields sat beside the device's: the same measurements, split."""
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; delete it and calibrate again")
    host = {k: data[k] for k in SHARED + ("large_elementwise_bandwidth", "huge_elementwise_bandwidth") if k in data}
    device = {k: v for k, v in data.items() if k not in host and k != "cores_per_node"}
    host.update(kind=TimeSharedCpu.kind, cores=data.get("cores_per_node", 1))
    return from_json(device | {"backend": "gloo", "host": host}, path)
