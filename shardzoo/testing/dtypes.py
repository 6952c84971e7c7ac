"""Dtypes by name and every tolerance the tests compare with, each with where it comes from.

A test keeps its own dtype set by naming it: ``DTYPES = dtypes("fp32", "fp64")`` parametrizes
over those two names in that order. Pairs are (rtol, atol) except the kernel tolerances, which
are (atol, rtol) as ``shardzoo.testing.kernels.assert_close`` takes them.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp64": torch.float64,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtypes(*names: str) -> dict[str, torch.dtype]:
    """The dtypes of ``names`` (keys of ``DTYPES``), in the order given."""
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype names {unknown}; use {', '.join(DTYPES)}")
    return {n: DTYPES[n] for n in names}


# (rtol, atol) per dtype for parallel-vs-serial comparisons of the same math (testing.assert_close).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}

GRID_SCALE = 8  # tolerance multiple of the grid layouts: block sums add in another order than serial

# Outputs and losses are compared at the fp32 tolerance itself (|a - e| <= 1e-6 + 1e-5 |e|): the
# largest error measured over every family and layout here is 0.18x that allowance (max abs
# error 2.7e-7 on logits up to 1.0). Gradients get 4x it: BERT's gradients (up to 25 in size,
# from the pooled term) reach 1.63x (abs 6.7e-6, embedding gradient, 2D tp4), and 0.90x already
# in serial (tp=1: transformers' math in another fp32 summation order), so that is the rounding
# of fp32 accumulation at this gradient size rather than the tp split; the other families stay
# below 0.21x.
HF_GRAD_SCALE = 4

# bf16 inputs vs the fp64 reference on the same rounded inputs (docs/sequence_parallel.md)
SEQUENCE_BF16_TOL = {"out": (2e-2, 2e-2), "grad": (5e-2, 5e-2)}

# bf16 compute (FSDP2 MixedPrecisionPolicy, fp32 master weights and reduce) after 3 AdamW steps
# against fp32 serial, relative L2 error of all weights together: measured 1.02e-2 (1d, tp=2,
# dp=2, zero 2 and 3 alike). Single tensors differ more where they are small: the biases start
# at zero, so after 3 steps they are only Adam's steps, whose signs bf16 noise flips (fc2.bias
# 0.14). The bound leaves 3x.
ZERO_BF16_REL_TOL = 3e-2

# (atol, rtol) of a kernel output against plain torch in fp32 on the same (upcast) inputs.
# Low-precision rows cover rounding the result to the input dtype (the interpreter rounds
# toward zero, so up to one full ulp) and, for gradients, the rounded `out` in D = rowsum(dO*O).
KERNEL_OUT_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
KERNEL_GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2)}
KERNEL_LSE_TOL = (1e-4, 1e-5)  # lse is fp32 from exactly upcast inputs, whatever the input dtype
