"""Shared settings for the kernel tests (tests/kernel_tests): device, tolerances, plain-torch attention.

Imports pytest (for ``needs_triton``); not imported by ``shardzoo.testing`` itself."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shardzoo.kernels import HAS_TRITON
from shardzoo.kernels._triton import interpreting
from shardzoo.testing.dtypes import KERNEL_GRAD_TOL as GRAD_TOL
from shardzoo.testing.dtypes import KERNEL_OUT_TOL as OUT_TOL
from shardzoo.testing.dtypes import dtypes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNNABLE = HAS_TRITON and (DEVICE.type == "cuda" or interpreting())
needs_triton = pytest.mark.skipif(
    not TRITON_RUNNABLE, reason="needs triton plus a CUDA device or TRITON_INTERPRET=1 (set by conftest on CPU)")

# OUT_TOL, GRAD_TOL: (atol, rtol) of a kernel against plain torch, from testing/dtypes.py
DTYPES = tuple(dtypes("fp32", "fp16", "bf16").values())  # the kernels' input dtypes


def assert_close(actual, expected, tol, scale_atol=True, msg=""):
    """allclose in fp32; with scale_atol the atol is relative to max |expected| (for gradients)."""
    atol, rtol = tol
    expected = expected.float()
    if scale_atol:
        atol = atol * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol, msg=msg or None)


def visible_mask(b, sq, sk, causal, key_padding_mask, device=DEVICE):
    """Bool [B, 1, Sq, Sk]: True where query i may attend key j."""
    mask = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=device)
    if causal:
        mask &= torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    if key_padding_mask is not None:
        mask &= key_padding_mask[:, None, None, :]
    return mask


def sdpa_attention(q, k, v, causal=False, key_padding_mask=None, softmax_scale=None):
    """Plain torch attention in fp32 (fp64 for fp64 input) with an explicit boolean mask -> (out, lse).

    Rows without a visible key give out = 0 and lse = -inf (SDPA alone would give NaN).
    Differentiable in q, k, v.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(ct), k.to(ct), v.to(ct)
    b, _, sq, d = q.shape
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    mask = visible_mask(b, sq, k.shape[2], causal, key_padding_mask, q.device)
    has_key = mask.any(-1, keepdim=True)  # [B, 1, Sq, 1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, scale=scale)
    out = torch.where(has_key, out, torch.zeros_like(out))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, -1)


def random_padding_mask(gen, b, sk, empty_row=False, device=DEVICE):
    """Random bool [B, Sk] keep-mask; with empty_row, batch 0 keeps no key at all."""
    mask = torch.rand(b, sk, generator=gen) > 0.3
    if empty_row:
        mask[0] = False
    return mask.to(device)


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    """Normal samples of ``shape`` from ``gen``, times ``scale``, in ``dtype`` on DEVICE."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any torch op produces (``largest``: its numel), as a context manager."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result
