"""What a plan style is: the :class:`Style` base, the :class:`Build` context it builds in, and
:class:`Whole`, the "layer" of a module every rank keeps whole.

A style (one per plan word: "column", "norm", "lm_head", ...) says which module kinds it
accepts (``check``, before anything moves), whether the modules inside a planned one are
planned on their own (``keeps_children``), which layer class each tp_mode builds (``layers``:
tp_mode -> :class:`Layer`) and how (``build``), and what it installs on the model once the
layers are in place (``install``). ``parallelize`` and the planner read styles only through
the registry (styles/__init__.py) and never compare style names themselves.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from torch import nn


@dataclass
class Build:
    """Where one planned module is built: the mesh's layout object (``layout_of(mesh)``), the
    model, every planned module ({name: (serial module, style, pattern)}), the attention
    modules (heads.py), whether the sp shards are zigzag (a causal model), the layers built so
    far ({name: layer}; embeddings first, so a tied head finds its table) and the name of the
    module being built. Options of how layers are built (for every style) are fields here."""

    layout: object
    model: nn.Module
    planned: dict
    attention: dict
    zigzag: bool
    built: dict = field(default_factory=dict)
    name: str = ""

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def mode(self) -> str:
        return self.layout.mode

    def at(self, name: str) -> "Build":
        """This context for building ``name`` (the same ``built`` dict)."""
        return dataclasses.replace(self, name=name)


class Layer(NamedTuple):
    """A style's layer in one tp_mode: the class (its ``from_serial(serial, mesh, device,
    **options)``) and the options it is built with, a function of the :class:`Build`."""

    cls: type
    options: Callable[[Build], dict] = lambda ctx: {}


def canonical(ctx: Build) -> dict:
    """Options of a grid layer reading the canonical activation placement."""
    return {"placement": ctx.layout.activation}


class Whole:
    """The 1d "layer" of a module every tp rank keeps whole: a copy of the serial module (as
    ``from_serial`` copies, so the serial module and the layer never share weights)."""

    @classmethod
    def from_serial(cls, module: nn.Module, mesh, device=None, **options) -> nn.Module:
        module = copy.deepcopy(module)
        return module.to(device) if device is not None else module


class Style:
    """One plan style (module doc). Subclasses set ``name``, ``needs`` (the kinds it accepts, in
    words, for errors), ``accepts`` and ``layers``, and override ``build`` / ``install`` where
    the layer is more than ``layers[mode].from_serial(module)``."""

    name = ""
    needs = "any module"
    keeps_children = False  # True: hooked in place; the plan still covers the modules inside
    builds_first = False  # True: built before the others (a tied head needs the table's layer)
    # True: inside a 1d block under Megatron sequence parallelism (megatron_sp.py) its layer runs
    # on this rank's chunk of the sequence and stays exact (its weight gradients summed over tp)
    on_sequence_chunks = False
    layers: dict[str, Layer] = {}

    def accepts(self, module: nn.Module) -> bool:
        return True

    def check(self, name: str, module: nn.Module, pattern: str) -> None:
        """Raise unless ``module`` (planned as ``name`` by ``pattern``) is of a kind this style
        splits; nothing has moved yet."""
        if not self.accepts(module):
            raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a {self.name!r} block, "
                             f"which needs {self.needs}; change the style or the pattern")

    def check_mesh(self, name: str, module: nn.Module, mesh, mode: str) -> None:
        """Raise unless ``module`` (planned as ``name``) splits over ``mesh`` in tp_mode ``mode``
        (rules of a mesh axis the layouts do not check, such as ep); nothing has moved yet."""

    def layer(self, serial: nn.Module, ctx: Build, device=None, **extra) -> nn.Module:
        """This tp_mode's layer of this style from ``serial``, on ``device`` (default the
        serial module's)."""
        cls, options = self.layers[ctx.mode]
        if device is None:
            weight = getattr(serial, "weight", None)
            device = weight.device if weight is not None else None
        return cls.from_serial(serial, ctx.mesh, device=device, **options(ctx), **extra)

    def build(self, module: nn.Module, ctx: Build) -> nn.Module | None:
        """The layer replacing ``module`` (``ctx.name``), or None: the module stays as it is."""
        return self.layer(module, ctx)

    def install(self, module: nn.Module, ctx: Build) -> None:
        """Hooks on the model once every layer is in place; ``module`` is what ``ctx.name`` now
        holds (the built layer, or the module kept in place)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
