"""Backend selection and the input checks shared by all kernels.

Dispatch rule: ``backend="auto"`` runs Triton for CUDA tensors (when Triton is
installed) and the torch reference otherwise; ``"triton"`` and ``"torch"`` force one.
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, interpreting

BACKENDS = ("auto", "triton", "torch")
HALF_AND_SINGLE = (torch.float32, torch.float16, torch.bfloat16)


def resolve_backend(backend: str, device: torch.device, op: str) -> str:
    """Return ``"triton"`` or ``"torch"`` for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {BACKENDS}; pass 'auto', 'triton' or 'torch'")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (HAS_TRITON and device.type == "cuda") else "torch"
    if not HAS_TRITON:
        raise ValueError(f"{op}: backend='triton' needs the triton package, which is not installed; "
                         "install triton or pass backend='torch'")
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return "triton"
    raise ValueError(f"{op}: backend='triton' got {device.type} tensors; Triton runs CUDA tensors, and CPU tensors "
                     "only under TRITON_INTERPRET=1. Move the tensors to CUDA, set TRITON_INTERPRET=1, "
                     "or pass backend='torch'")


def check_tensor(op: str, name: str, t, ndim=None, dtypes=None, layout: str = "") -> None:
    """Check that ``t`` is a tensor with the given rank (``layout`` names the dims) and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        dims = f"{ndim} dims {layout}".strip()
        raise ValueError(f"{op}: {name} must have {dims}, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: {name}.dtype={t.dtype} is not supported; use one of {names} "
                         f"(e.g. {name}.to(torch.float32))")


def check_same_device(op: str, **tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: tensors are on different devices {devices}; move them to one device")


def check_triton_float(op: str, name: str, t) -> None:
    """Triton kernels take fp32 / fp16 / bf16 only."""
    if t.dtype not in HALF_AND_SINGLE:
        raise ValueError(f"{op}: {name}.dtype={t.dtype} is not supported by the Triton kernel (fp32, fp16, bf16); "
                         "cast the input or pass backend='torch'")
