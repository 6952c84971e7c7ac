"""Optional Triton import and the helpers every kernel launcher shares.

The package must import on machines without Triton, so nothing outside the
``*_triton.py`` modules imports ``triton`` directly; they read it from here.
"""
from __future__ import annotations

import os
import types

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
        return self.wrapped(interpreting())[grid]

    def wrapped(self, mode: bool):
        """``triton.jit`` of the function for one mode (interpreter or compiler), made once;
        the device functions it calls (:func:`jit_device`) are wrapped in the same mode."""
        kernel = self._by_mode.get(mode)
        if kernel is None:
            kernel = self._by_mode[mode] = triton.jit(_with_device_functions(self.fn, mode))
        return kernel


def _with_device_functions(fn, mode: bool):
    """``fn`` with every :func:`jit_device` function among its globals replaced by its
    ``triton.jit`` wrapper for ``mode`` (Triton resolves called names through the globals)."""
    helpers = {name: value for name, value in fn.__globals__.items()
               if isinstance(value, LazyDeviceFunction) and value.fn is not fn}
    if not helpers:
        return fn
    scope = dict(fn.__globals__, **{name: helper.wrapped(mode) for name, helper in helpers.items()})
    bound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__module__, bound.__qualname__, bound.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    return bound


class LazyDeviceFunction(LazyKernel):
    """A ``triton.jit`` function called from kernels (not launched itself), wrapped in the
    mode of the kernel that calls it."""

    def __getitem__(self, grid):
        raise TypeError(f"{self.fn.__name__} is a device function: call it from a kernel, do not launch it")


def jit(fn) -> LazyKernel:
    """Decorator for the kernels of this package (see :class:`LazyKernel`)."""
    return LazyKernel(fn)


def jit_device(fn) -> LazyDeviceFunction:
    """Decorator for device functions shared by several kernels (see :class:`LazyDeviceFunction`)."""
    return LazyDeviceFunction(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
