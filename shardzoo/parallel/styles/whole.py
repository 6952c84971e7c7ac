"""The styles that keep a module as it is on every rank: 'replicate', 'replicate_sum' (its
gradient summed over tp: each rank saw another part of the data, as Qwen3's per-head q_norm:
replicated.py) and 'first_token' (a module reading token 0 of its input, which under sp gets
the global token 0: first_token.py; its children are planned on their own); and 'dropout',
an ``nn.Dropout`` drawing its masks through the layout (dropouts.py)."""

from __future__ import annotations

from torch import nn

from shardzoo.parallel.dropouts import build_dropout
from shardzoo.parallel.first_token import install_first_token
from shardzoo.parallel.replicated import sum_grads_over
from shardzoo.parallel.styles.base import Build, Style


class Replicate(Style):
    """The module stays whole on every rank."""

    name = "replicate"

    def build(self, module: nn.Module, ctx: Build) -> None:
        return None


class ReplicateSum(Replicate):
    """Whole on every rank, each rank's gradient a partial sum over tp."""

    name = "replicate_sum"
    on_sequence_chunks = True  # its gradient is summed over tp

    def install(self, module: nn.Module, ctx: Build) -> None:
        sum_grads_over(module, ctx.mesh.tp_group)


class FirstToken(Replicate):
    """Reads the global token 0 under sp: [b, s, ...] -> [b, 1, ...] before its forward."""

    name = "first_token"
    keeps_children = True

    def install(self, module: nn.Module, ctx: Build) -> None:
        install_first_token(module, ctx.layout)


class Dropout(Style):
    """The layout's dropout (one mask on every tp rank where the activation is replicated, per
    rank where it is split), any tp_mode: any shape -> same shape."""

    name = "dropout"
    on_sequence_chunks = True
    needs = "an nn.Dropout (elementwise)"

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Dropout)

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        return build_dropout(module, ctx.mesh)
