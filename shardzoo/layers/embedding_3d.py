"""Embeddings on a 3D layout (I, J | L), default (tp_x, tp_y | tp_z); see embedding_2d.py.

* ``Embedding3D``: table [V, H] cut into q^3 hidden chunks, gathered over I*J in forward.
* ``VocabParallelEmbedding3D``: rank (i, j, l) holds vocabulary chunk j*q + i of q^2 (padded)
  and hidden block l, which is ParallelLinear3D's weight placement for the same activation placement, so
  ``LMHead3D(tie_to=...)`` shares it. Forward: gather the table over I, ids over J, masked
  lookup, reduce-scatter over J.
* ``PatchEmbedding3D``: ViT patch embedding, every H-indexed tensor cut into q^3 chunks.
"""

from __future__ import annotations

from shardzoo.layers.embedding_2d import GridEmbedding, GridVocabParallelEmbedding
from shardzoo.layers.patch_embedding_2d import GridPatchEmbedding


class Embedding3D(GridEmbedding):
    """``nn.Embedding`` on a tp_mode="3d" mesh (embedding_dim divisible by q^3).
    ids [B/q^2, ...] -> [B/q^2, ..., H/q]."""

    mode = "3d"


class VocabParallelEmbedding3D(GridVocabParallelEmbedding):
    """``nn.Embedding`` on a tp_mode="3d" mesh (vocabulary padded to a multiple of q^2,
    embedding_dim divisible by q). ids [B/q^2, ...] -> [B/q^2, ..., H/q]."""

    mode = "3d"


class PatchEmbedding3D(GridPatchEmbedding):
    """ViT patch embedding on a tp_mode="3d" mesh: [B/q^2, C, img, img] -> [B/q^2, N+1, H/q]
    (hidden_size divisible by q^3)."""

    mode = "3d"
