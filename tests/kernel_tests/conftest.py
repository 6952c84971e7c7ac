"""Kernel tests run the Triton kernels on CPU through the Triton interpreter when no GPU is present.

The root tests/conftest.py sets TRITON_INTERPRET before any test module can import
shardzoo.kernels (Triton reads it when a kernel is first wrapped); this keeps the directory
runnable on its own too.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
