"""The ``first_token`` style: a module that reads token 0 of its input (a pooler's
``hidden[:, 0]``, a classifier on the cls token) sees the whole sequence's token 0 under sp.

Under sp token 0 lives on sp rank 0 only; every other rank's ``x[:, 0]`` is another token.
A forward pre-hook replaces the module's first input [b, s, ...] by the global token 0 as
[b, 1, ...] on every sp rank (``TensorLayout.first_token``: a broadcast from sp rank 0 whose
backward sums the gradient there), so the module's own ``x[:, 0]`` reads it. The module itself
stays as it is; its children are planned like any others.
"""

from __future__ import annotations

from torch import nn


class GlobalFirstToken:
    """Forward pre-hook: first input [b, s, ...] -> the global token 0, [b, 1, ...]."""

    def __init__(self, layout):
        self.layout = layout

    def __call__(self, module: nn.Module, args: tuple):
        x, rest = args[0], args[1:]
        if self.layout.mesh.sp_size == 1:
            return None  # token 0 is this rank's own
        return (self.layout.first_token(x)[:, None], *rest)


def install_first_token(module: nn.Module, layout) -> None:
    """Make ``module`` read the global token 0 under sp (module doc); in place."""
    module.register_forward_pre_hook(GlobalFirstToken(layout))
