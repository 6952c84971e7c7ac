"""Kernel tests run the Triton kernels on CPU through the Triton interpreter when no GPU is present.

TRITON_INTERPRET is set here at import time, before any test module imports shardzoo.kernels.
(The kernels also read it at launch, not at import, so an earlier import would not break this.)
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
