"""The base of every parallel layer: one way to build it from a serial module.

``Layer.from_serial(module, mesh, device=None, **options)`` makes this rank's piece of an
existing ``torch.nn`` module (weights copied from it, the same module on every rank, so the
parallel layer equals its serial twin at step 0). It is defined once, here: a layer class only
writes ``_setup(serial, mesh, device, **options)``, which its constructor also calls after
drawing a fresh serial module, so both paths place parameters the same way.
"""

from __future__ import annotations

import torch
from torch import nn


class ParallelModule(nn.Module):
    """``from_serial`` for every parallel layer (module docstring), and the identity
    ``shard_input`` / ``gather_output`` of a module whose activations are replicated."""

    @classmethod
    def from_serial(cls, module: nn.Module, mesh, device=None, **options):
        """This rank's piece of ``module`` (same on every rank); ``options`` as the layer's
        constructor (``style=``, ``layout=``, ``sequence_parallel=`` ...)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(module, mesh, device, **options)
        return self

    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """Identity: a module whose input is replicated takes the full tensor (the grid modules
        and split-input 1D layers override this)."""
        return x_full

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """Identity: a module whose output is replicated gives the full tensor already."""
        return y_local

    def _setup(self, serial: nn.Module, mesh, device, **options) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _setup(serial, mesh, device, **options)")
