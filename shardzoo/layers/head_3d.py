"""Classifier and LM head on a 3D layout (see head_2d.py for the classifier).

``LMHead3D`` is the 3D linear product (linear_3d.py) with the weight E [V, H] placed as in
``VocabParallelEmbedding3D`` for the same input placement (vocabulary chunk j*q + i of q^2, hidden
block l on rank (i, j, l)), so ``tie_to=embedding`` shares the Parameter. The logits come out
in the swapped placement (I, L | J): [B/q^2, ..., V_pad/q], vocabulary block j on rank (i, j, l);
``shard_target`` splits targets that way and ``loss`` is the vocab-parallel cross entropy over J.
"""

from __future__ import annotations

import torch

from shardzoo.layers import placements
from shardzoo.layers.head_2d import GridClassifier, GridLMHead
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.linear_3d import linear_3d
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec, shard_param


class Classifier3D(GridClassifier):
    """Classifier on a 3D layout: x [B/q^2, ..., H/q] -> logits [B/q^2, ..., C]
    (in_features divisible by q^3)."""

    mode = "3d"


class LMHead3D(GridLMHead):
    """LM head on a 3D layout, optionally tied to a ``VocabParallelEmbedding3D`` with the same
    placement: x [B/q^2, ..., H/q] (``placement``) -> logits [B/q^2, ..., V_pad/q] (``output_placement``)."""

    mode = "3d"

    def _place_bias(self, bias: torch.Tensor, device) -> None:
        out = self.output_placement
        spec = ShardSpec((self.vocab_size,), (self.vocab_start,), (self.vocab_per_rank,), (out.hidden_axis,),
                         out.batch_axes)
        shard_param(self, "bias", bias, spec, self.weight.device)

    def _finish(self) -> None:
        self.vocab_per_rank = get_shard_spec(self, "weight").local_shape[0] * self.mesh.q  # after the gather over I
        self.vocab_start = self.mesh.rank(self.output_placement.hidden_axis) * self.vocab_per_rank

    @property
    def output_placement(self) -> ActivationPlacement:
        return placements.swapped_3d(self.placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/q^2, ..., H/q] -> vocab-parallel logits [B/q^2, ..., V_pad/q]."""
        self._check_input(x, self.in_features)
        logits = linear_3d(x, self.weight, self.mesh, self.placement)
        if self.bias is not None:
            logits = logits + placements.use_block_param(self.bias, self.mesh, self.output_placement)
        return logits
