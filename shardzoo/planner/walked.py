"""A model and its plan as the shape the planner prices (walk.py reads it, walk_pieces.py
prices it): ``shardzoo.plan(walked_model(model, plan), ...)``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn

from shardzoo.planner.model import ModelShape
from shardzoo.planner.walk import Walk, walk_model
from shardzoo.planner.walk_pieces import check_walk, walk_parts


def _max_positions(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2**62  # no learned or stated limit


@dataclass(frozen=True, eq=False)
class WalkedShape(ModelShape):
    """A model and its plan, priced from its modules (``walk``) rather than a family's formulas.
    ``family`` is the config's ``model_type`` (or the class name), for messages."""

    walk: Walk | None = None

    walked = True
    pipelines = False  # parallelize builds pp = 1 only

    @property
    def hidden(self) -> int:
        head = next(s.module for s in self.walk.post if s.style == "lm_head")
        return head.in_features

    @property
    def layers(self) -> int:
        return len(self.walk.blocks)

    @property
    def heads(self) -> int:
        return next(iter(self.walk.attention.values())).heads if self.walk.attention else 0

    @property
    def vocab(self) -> int:
        return next(s.module for s in self.walk.post if s.style == "lm_head").out_features

    @property
    def causal(self) -> bool:
        return self.walk.causal

    @property
    def max_seq(self) -> int:
        """The config's positions, and the rows of any table indexed by position (an embedding
        whose ids are one row broadcast over the batch)."""
        tables = [s.module.num_embeddings for s in self.walk.pre
                  if s.style in ("embedding", "position_embedding") and s.lead == 1]
        return min([_max_positions(self.config), *tables])

    @property
    def parameters(self) -> int:
        """Serial parameter elements, each tensor once."""
        return sum(p.numel() for p in {id(p): p for p in self.walk.model.parameters()}.values())

    def check(self, costs, b) -> None:
        check_walk(self, costs, b)

    def parts(self, costs, b):
        return walk_parts(self, costs, b)


def walked_model(model: nn.Module, plan: dict[str, str] | None = None, name: str = "") -> WalkedShape:
    """``model`` and its ``plan`` (None: its default plan) as the shape the planner prices:
    ``shardzoo.plan(walked_model(model, plan), ...)``; ``shardzoo.plan(model, ...)`` does this with
    the default plan. Build ``model`` on the meta device (``with torch.device("meta"):``) to hold
    no weights."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None) or type(model).__name__
    return WalkedShape(family, config if config is not None else SimpleNamespace(), name or family,
                       walk_model(model, plan))
