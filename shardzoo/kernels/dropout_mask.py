"""The counter-based (stateless) dropout mask of the attention kernels.

Whether attention probability ``P[b, head, i, j]`` is kept is a pure function of
``(seed, b, head, i, j)`` with *global* batch index, head index, query position and key
position, so the mask does not depend on how the batch, heads or sequence are sharded: ring
attention (zigzag shards), Ulysses and tensor-parallel heads draw exactly the mask of the
serial model for the same seed. Nothing is stored between forward and backward.

Definition (all arithmetic on unsigned 32-bit words, wrapping; ``fmix32`` is MurmurHash3's
finaliser, a bijection with full avalanche)::

    step(h, x)    = fmix32(h ^ fmix32(x + 0x9E3779B9))
    seed_key      = step(step(0x9E3779B9, seed mod 2^32), (seed >> 32) mod 2^32)
    row_key       = step(step(step(seed_key, b), head), i)         # one word per query row
    col_key       = step(step(seed_key, 0x5EED), j)                # one word per key column
    keep[i, j]    = (fmix32(row_key + col_key) >> 1) >= threshold  # threshold = round(p * 2^31)

The row and column keys are computed here in torch (int64 holding 32-bit values) and handed
to the kernels; the per-element ``fmix32(row_key + col_key)`` runs both here (the torch
reference) and in the Triton kernels (uint32), bit for bit the same.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
COL_SALT = 0x5EED
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35


def _mul32(h, c: int):
    """(h * c) mod 2^32 for h in [0, 2^32) without overflowing int64 (c split in 16-bit halves)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def fmix32(h):
    """MurmurHash3 finaliser on 32-bit words (Python int or int64 tensor with values < 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_C2)
    return h ^ (h >> 16)


def _step(h, x):
    return fmix32(h ^ fmix32((x + GOLDEN) & MASK32))


def keep_threshold(p: float) -> int:
    """The int31 threshold: a 31-bit hash below it is dropped, so P(drop) = p (to 2^-31)."""
    return min(round(p * 2 ** 31), 2 ** 31 - 1)


class DropoutKeys(NamedTuple):
    """What a kernel needs to draw the mask: row_keys int64 [B, H, Sq] and col_keys int64
    [Sk] (32-bit values), the int31 ``threshold`` and the survivors' ``scale`` 1 / (1 - p)."""

    row_keys: torch.Tensor
    col_keys: torch.Tensor
    threshold: int
    scale: float


def dropout_keys(p: float, seed: int, batch: int, heads: int, q_positions: torch.Tensor,
                 k_positions: torch.Tensor, *, batch_offset: int = 0, head_offset: int = 0) -> DropoutKeys:
    """Keys of the mask for a [batch, heads, Sq, Sk] block.

    Args:
        p: drop probability in [0, 1). seed: any Python int (its low 64 bits are used).
        batch, heads: local sizes; the global indices are ``batch_offset + b``, ``head_offset + h``.
        q_positions: int64 [Sq], k_positions: int64 [Sk]: global sequence positions (< 2^32).
    """
    seed = int(seed) & (2 ** 64 - 1)
    seed_key = _step(_step(GOLDEN, seed & MASK32), seed >> 32)
    dev = q_positions.device
    b = torch.arange(batch_offset, batch_offset + batch, dtype=torch.int64, device=dev) & MASK32
    h = torch.arange(head_offset, head_offset + heads, dtype=torch.int64, device=dev) & MASK32
    i = q_positions.to(torch.int64) & MASK32
    row = _step(_step(_step(seed_key, b)[:, None, None], h[None, :, None]), i[None, None, :])
    col = _step(_step(seed_key, COL_SALT), k_positions.to(torch.int64) & MASK32)
    return DropoutKeys(row, col, keep_threshold(p), 1.0 / (1.0 - p))


def keep_mask(row_keys: torch.Tensor, col_keys: torch.Tensor, threshold: int) -> torch.Tensor:
    """bool keep-mask from broadcastable keys, e.g. row_keys [B, H, Sq, 1] and col_keys [Sk]."""
    return (fmix32((row_keys + col_keys) & MASK32) >> 1) >= threshold


def dense_keep_mask(p: float, seed: int, batch: int, heads: int, q_positions: torch.Tensor,
                    k_positions: torch.Tensor, *, batch_offset: int = 0, head_offset: int = 0) -> torch.Tensor:
    """The whole bool mask [batch, heads, Sq, Sk] (True = kept), for tests and small inputs."""
    keys = dropout_keys(p, seed, batch, heads, q_positions, k_positions, batch_offset=batch_offset,
                        head_offset=head_offset)
    return keep_mask(keys.row_keys[..., None], keys.col_keys, keys.threshold)


def as_int32(keys: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 -> the same bits as int32 (what the Triton kernels load)."""
    return torch.where(keys >= 2 ** 31, keys - 2 ** 32, keys).to(torch.int32).contiguous()
