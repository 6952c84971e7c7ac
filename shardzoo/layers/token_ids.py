"""The range check every embedding makes on its token ids, as ``nn.Embedding`` does.

A vocabulary-parallel lookup treats an id outside a rank's block as "another rank holds it"
and writes zeros, so an id >= V (or < 0) would embed to zeros on every rank without a word.
Each embedding checks the ids it already holds before its lookup: no collective, one min / max
over the ids (on an accelerator that reads two numbers back, a device sync).
"""

from __future__ import annotations

import torch


def check_token_ids(ids: torch.Tensor, num_embeddings: int, who: str) -> None:
    """Raise ``IndexError`` when an id of ``ids`` [...] is outside ``[0, num_embeddings)``,
    naming the id, the vocabulary size and the fix; ``who`` names the layer or model."""
    if ids.numel() == 0 or ids.is_floating_point() or ids.device.type == "meta":
        return  # float ids are refused by the lookup itself; meta tensors hold no values
    low, high = (int(v) for v in torch.aminmax(ids))
    if low >= 0 and high < num_embeddings:
        return
    bad = high if high >= num_embeddings else low
    fix = (f"check that the tokenizer matches the model, or build the model with a vocabulary of at least {high + 1}"
           if bad >= 0 else "negative ids are not tokens (-100 marks ignored labels): pass the input ids, not labels")
    raise IndexError(f"{who}: token id {bad} is out of range for a vocabulary of {num_embeddings} (ids must be in "
                     f"[0, {num_embeddings}), as nn.Embedding requires); {fix}")
