"""Building a model without allocating its weights twice.

A model built on the meta device holds shapes, dtypes and ShardSpecs but no data; the serial
twins its layers slice from (``from_serial``) then cost nothing either. :func:`materialize`
gives every parameter uninitialised CPU (or ``device``) storage of its local shape, keeping
each Parameter's attributes (``shard_spec``) and sharing (tied weights stay one Parameter).
The caller then fills every value, e.g. from a checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Replace every meta parameter and buffer of ``model`` with empty storage on ``device``
    (in place; returns ``model``). Values are undefined until loaded."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in memo:
                    data = torch.empty(t.shape, dtype=t.dtype, device=device)
                    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
                    new.__dict__.update(t.__dict__)  # shard_spec and any other marks
                    memo[id(t)] = new
                store[name] = memo[id(t)]
    return model
