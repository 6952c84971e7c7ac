"""Comparisons used by parallel-vs-serial tests, with one tolerance table for every test."""

from __future__ import annotations

import torch

# (rtol, atol) per dtype for parallel-vs-serial comparisons of the same math.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for ``dtype`` from ``TOLERANCES``."""
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", scale: float = 1.0) -> None:
    """``torch.testing.assert_close`` with the dtype's tolerance (times ``scale``) and a label."""
    rtol, atol = tolerance(expected.dtype)
    torch.testing.assert_close(
        actual, expected, rtol=rtol * scale, atol=atol * scale, msg=lambda m: f"{what} differs: {m}"
    )
