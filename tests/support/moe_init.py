"""Tiny mixture-of-experts models drawn so that routing is decided: the routers' weights wide
(no near tie of the top-k scores that a parallel summation order could flip), the experts'
small."""

from __future__ import annotations

import torch
from torch import nn


def decided_routing(model: nn.Module, router_suffix: str = "mlp.gate.weight", expert_std: float = 0.1) -> nn.Module:
    """Redraw ``model``'s router weights (names ending ``router_suffix``) from N(0, 1) and its
    experts' from N(0, ``expert_std``), in place, from the current torch seed; returns it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(router_suffix):
                p.normal_(0.0, 1.0)
            elif "experts" in name:
                p.normal_(0.0, expert_std)
    return model
