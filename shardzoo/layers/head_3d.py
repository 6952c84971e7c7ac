"""Classifier and LM head on a 3D layout (see head_2d.py for the classifier).

``LMHead3D`` is the 3D linear product (linear_3d.py) with the weight E [V, H] placed as in
``VocabParallelEmbedding3D`` for the same input layout (vocabulary chunk j*q + i of q^2, hidden
block l on rank (i, j, l)), so ``tie_to=embedding`` shares the Parameter. The logits come out
in the swapped layout (I, L | J): [B/q^2, ..., V_pad/q], vocabulary block j on rank (i, j, l);
``shard_target`` splits targets that way and ``loss`` is the vocab-parallel cross entropy over J.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo.layers import layouts
from shardzoo.layers.embedding_2d import GridVocabParallelEmbedding, vocab_parallel_param
from shardzoo.layers.head_2d import GridClassifier, grid_cross_entropy
from shardzoo.layers.layouts import ActivationLayout
from shardzoo.layers.linear_3d import linear_3d
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec, shard_param, tie_param


class Classifier3D(GridClassifier):
    """Classifier on a 3D layout: x [B/q^2, ..., H/q] -> logits [B/q^2, ..., C]
    (in_features divisible by q^3)."""

    mode = "3d"


class LMHead3D(layouts.GridModule):
    """LM head on a 3D layout, optionally tied to a ``VocabParallelEmbedding3D`` with the same
    layout: x [B/q^2, ..., H/q] (``layout``) -> logits [B/q^2, ..., V_pad/q] (``output_layout``)."""

    mode = "3d"

    def __init__(self, in_features: int, vocab_size: int, bias: bool = False, *, mesh, tie_to=None, dtype=None,
                 device=None, layout: ActivationLayout | None = None):
        super().__init__()
        if tie_to is None:
            serial = nn.Linear(in_features, vocab_size, bias, dtype=dtype, device="cpu")
            self._setup(serial, mesh, device, layout)
            return
        if bias:
            raise ValueError("LMHead3D(tie_to=...) shares the embedding's weight and has no bias; pass bias=False")
        self._bind(mesh, layout or getattr(tie_to, "layout", None))
        same_place = isinstance(tie_to, GridVocabParallelEmbedding) and tie_to.mesh is mesh and tie_to.layout == self.layout
        if not same_place or (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, in_features):
            raise ValueError(f"LMHead3D(in_features={in_features}, vocab_size={vocab_size}) cannot tie to {tie_to}; "
                             f"tie to a VocabParallelEmbedding3D of the same mesh and layout with "
                             f"embedding_dim=in_features, num_embeddings=vocab_size")
        self.in_features, self.vocab_size = in_features, vocab_size
        tie_param(self, "weight", tie_to)
        self.register_parameter("bias", None)
        self._finish()

    def _setup(self, serial: nn.Linear, mesh, device, layout: ActivationLayout | None = None) -> None:
        self._bind(mesh, layout)
        self.in_features, self.vocab_size = serial.in_features, serial.out_features
        layouts.check_divisible("LMHead3D", "in_features", self.in_features, mesh.q, f"q={mesh.q}")
        vocab_parallel_param(self, serial.weight, mesh, self.layout, device)
        self._finish()
        if serial.bias is None:
            self.register_parameter("bias", None)
            return
        out = self.output_layout
        spec = ShardSpec((self.vocab_size,), (self.vocab_start,), (self.vocab_per_rank,), (out.hidden_axis,),
                         out.batch_axes)
        shard_param(self, "bias", serial.bias, spec, self.weight.device)

    def _finish(self) -> None:
        self.vocab_per_rank = get_shard_spec(self, "weight").local_shape[0] * self.mesh.q  # after the gather over I
        self.vocab_start = self.mesh.rank(self.output_layout.hidden_axis) * self.vocab_per_rank

    @property
    def output_layout(self) -> ActivationLayout:
        return layouts.swapped_3d(self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/q^2, ..., H/q] -> vocab-parallel logits [B/q^2, ..., V_pad/q]."""
        self._check_input(x, self.in_features)
        logits = linear_3d(x, self.weight, self.mesh, self.layout)
        if self.bias is not None:
            logits = logits + layouts.use_block_param(self.bias, self.mesh, self.output_layout)
        return logits

    def loss(self, logits: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
        """Cross entropy of this head's logits against target ids [B/q^2, ...] (``shard_target``);
        kwargs: ignore_index, label_smoothing, reduction."""
        return grid_cross_entropy(logits, target, mesh=self.mesh, layout=self.output_layout,
                                  vocab_start=self.vocab_start, vocab_size=self.vocab_size, **kwargs)

    def shard_target(self, target_full: torch.Tensor) -> torch.Tensor:
        """Target ids [B, ...] -> this rank's batch block in ``output_layout``."""
        return layouts.shard_batch(target_full, self.mesh, self.output_layout, "LMHead3D")

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel [B/q^2, ..., V_pad/q] -> [B, ..., V] (padding dropped)."""
        return super().gather_output(y_local)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, vocab_size={self.vocab_size}, layout=({self.layout})"
