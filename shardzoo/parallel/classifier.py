"""The ``classifier`` style: an ``nn.Linear`` head onto a few classes (a ViT's or a sequence
classifier's), whose logits every rank holds whole for its batch rows.

The layout builds it (``TensorLayout.classifier``: replicated in 1d; in the grids the weight's
input features split like the hidden, the partial logits summed over the hidden axis), so
x [b, ..., H_l] -> logits [b, ..., C] in the input's batch rows, for a plain cross entropy.
Unlike an ``lm_head`` it never splits the classes, so a class count need not divide tp.
"""

from __future__ import annotations

from torch import nn


def build_classifier(module: nn.Linear, tpl) -> nn.Module:
    """The layout's classifier from ``module``: [b, ..., H_l] -> full logits [b, ..., C]."""
    return tpl.classifier(serial=module, device=module.weight.device)
