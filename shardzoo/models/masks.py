"""The padding mask of a plain model's ``F.scaled_dot_product_attention`` call.

A family stage built on a mesh never passes one: the stage builder takes the mask out of the
forward's arguments and the attention core applies it (shardzoo/parallel/stage.py). A plain
model run as it is (``GPT2Block`` on its own) gets it here.
"""

from __future__ import annotations

import torch


def sdpa_mask(key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """Key padding mask bool [b, s] (True = attend) -> SDPA's bool mask [b, 1, s, s] (causal:
    key j <= query i too), or None without padding. A query row with no key to attend attends
    every key (its output is padding, and a row of -inf would give NaN)."""
    if key_padding_mask is None:
        return None
    s = key_padding_mask.shape[-1]
    mask = key_padding_mask[:, None, None, :].expand(-1, 1, s, s)
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    return mask | ~mask.any(-1, keepdim=True)
