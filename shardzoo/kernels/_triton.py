"""Optional Triton import and the helpers every kernel launcher shares.

The package must import on machines without Triton, so nothing outside the
``*_triton.py`` modules imports ``triton`` directly; they read it from here.
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: every op falls back to its torch reference
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if HAS_TRITON and hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """A kernel wrapped by ``triton.jit`` on first launch rather than at import.

    ``triton.jit`` decides between the compiler and the interpreter when it wraps a
    function, so wrapping at launch lets ``TRITON_INTERPRET`` be set after this
    package was imported (for example by a test conftest loaded late).
    """

    def __init__(self, fn):
        self.fn = fn
        self._by_mode = {}

    def __getitem__(self, grid):
        mode = interpreting()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel[grid]


def jit(fn) -> LazyKernel:
    """Decorator for the kernels of this package (see :class:`LazyKernel`)."""
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
