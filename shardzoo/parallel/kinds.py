"""The module kinds the plan styles accept and the layouts split, by type or by a model's own
class name (transformers' ``Conv1D``, ``LlamaRMSNorm``), shared by ``parallelize`` and the
planner."""

from __future__ import annotations

from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: a linear layer storing its weight [in, out]."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a ``Conv1D``: what the linear styles split."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm, torch's or a model's own class of that name."""
    name = type(module).__name__.lower()
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("layernorm", "rmsnorm"))


def is_weighted_kind(module: nn.Module) -> bool:
    """The kinds the layouts split, which must be planned: Linear, Conv1D, Embedding, norms."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D" or is_norm(module)
