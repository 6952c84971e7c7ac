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


_HOOKS = "_param_hooks"  # module attribute: {parameter name: fn(param) -> tensor used in forward}


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of ``weight`` [out, in] and ``bias`` [out] (a serial module
    for ``from_serial`` made from tensors: a Conv1D's transposed weight, a padded one)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device="meta")
    lin.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone())
    return lin


class ParallelModule(nn.Module):
    """``from_serial`` for every parallel layer (module docstring), and the identity
    ``shard_input`` / ``gather_output`` of a module whose activations are replicated."""

    @classmethod
    def from_serial(cls, module: nn.Module, mesh, device=None, **options):
        """This rank's piece of ``module`` (same on every rank); ``options`` as the layer's
        constructor (``style=``, ``placement=``, ``sequence_parallel=`` ...)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(module, mesh, device, **options)
        return self

    def param(self, name: str) -> torch.Tensor | None:
        """Parameter ``name`` as ``forward`` uses it: through the hook registered for it with
        :meth:`set_param_hook` (e.g. replicated kv heads summing their gradients), else as is."""
        t = getattr(self, name)
        hook = self.__dict__.get(_HOOKS, {}).get(name)
        return t if hook is None or t is None else hook(t)

    def set_param_hook(self, name: str, hook) -> None:
        """Make ``forward`` use ``hook(param)`` instead of parameter ``name`` (identity in value;
        the hook may change the backward). Kept on the module, so wrappers that swap Parameter
        objects (FSDP2, DDP) keep it."""
        self.__dict__.setdefault(_HOOKS, {})[name] = hook

    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """Identity: a module whose input is replicated takes the full tensor (the grid modules
        and split-input 1D layers override this)."""
        return x_full

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """Identity: a module whose output is replicated gives the full tensor already."""
        return y_local

    def _setup(self, serial: nn.Module, mesh, device, **options) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _setup(serial, mesh, device, **options)")
