"""Building a model without allocating more than this rank's shards.

A model is built on the meta device: it holds shapes, dtypes and ShardSpecs but no data, and
the serial twins its layers slice from (``from_serial``) cost nothing either.
:func:`materialize` then gives every parameter uninitialised storage of its local shape, keeping
each Parameter's attributes and sharing (tied weights stay one Parameter); ShardSpecs live on
the modules (layers/shard_spec.py), so replacing the Parameter objects keeps them.
The caller fills every value: from a checkpoint, or :func:`seeded_normal_piece`, which draws
this rank's piece of a seeded full tensor without forming the full tensor.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from shardzoo.layers.shard_spec import ShardSpec

ROWS_PER_DRAW = 64  # rows of the full tensor drawn per generator: the most drawn beyond a rank's piece


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
                    new.__dict__.update(t.__dict__)  # any marks set on the Parameter object
                    memo[id(t)] = new
                store[name] = memo[id(t)]
    return model


def seeded_normal_piece(seed: int, name: str, spec: ShardSpec, std: float) -> torch.Tensor:
    """This rank's piece (``spec.local_shape``, padding zero) of the full tensor ~ N(0, std)
    of ``spec.global_shape`` that (``seed``, ``name``) determine, in any layout.

    The full tensor is drawn in blocks of :data:`ROWS_PER_DRAW` rows, each from its own
    generator, so a rank draws only the row blocks its piece touches (never the whole tensor)
    and every layout sees the same values."""
    local = torch.zeros(spec.local_shape)
    if not spec.global_shape:
        return local
    rows = spec.valid_global()[0]
    rest = spec.valid_global()[1:]
    key = (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)
    for block in range(rows.start // ROWS_PER_DRAW, -(-rows.stop // ROWS_PER_DRAW)):
        lo, hi = block * ROWS_PER_DRAW, min((block + 1) * ROWS_PER_DRAW, spec.global_shape[0])
        gen = torch.Generator().manual_seed((key * 1_000_003 + block) % (1 << 62))
        draw = torch.randn((hi - lo, *spec.global_shape[1:]), generator=gen) * std
        a, b = max(lo, rows.start), min(hi, rows.stop)
        if a < b:
            dst = (slice(a - spec.offsets[0], b - spec.offsets[0]),) + tuple(
                slice(s.start - o, s.stop - o) for s, o in zip(rest, spec.offsets[1:]))
            local[dst] = draw[(slice(a - lo, b - lo),) + rest]
    return local
