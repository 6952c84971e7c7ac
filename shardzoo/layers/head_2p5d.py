"""Classifier and LM head on the 2.5D layout: the 2D ones (head_2d.py) inside each depth slice,
weights replicated over tp_dep with their gradients summed there."""

from __future__ import annotations

from shardzoo.layers.head_2d import GridClassifier, SummaLMHead


class Classifier2p5D(GridClassifier):
    """Classifier on the 2.5D layout: x [B/(d*q), ..., H/q] -> logits [B/(d*q), ..., C]
    (in_features divisible by q*q)."""

    mode = "2.5d"


class LMHead2p5D(SummaLMHead):
    """LM head on the 2.5D layout, optionally tied to a ``VocabParallelEmbedding2p5D``:
    x [B/(d*q), ..., H/q] -> vocab-parallel logits [B/(d*q), ..., V_pad/q] (vocab over tp_col)."""

    mode = "2.5d"
