"""Embeddings on the 2.5D layout: the 2D ones (embedding_2d.py, patch_embedding_2d.py) with the
batch split over tp_dep*tp_row and every table replicated over tp_dep (gradient summed there)."""

from __future__ import annotations

from shardzoo.layers.embedding_2d import GridEmbedding, GridVocabParallelEmbedding
from shardzoo.layers.patch_embedding_2d import GridPatchEmbedding


class Embedding2p5D(GridEmbedding):
    """``nn.Embedding`` on a tp_mode="2.5d" mesh, table split along the hidden dim into q*q
    chunks (embedding_dim divisible by q*q). ids [B/(d*q), ...] -> [B/(d*q), ..., H/q]."""

    mode = "2.5d"


class VocabParallelEmbedding2p5D(GridVocabParallelEmbedding):
    """``nn.Embedding`` on a tp_mode="2.5d" mesh, rank (k, i, j) holding vocabulary block i
    (padded to a multiple of q) and hidden block j. ids [B/(d*q), ...] -> [B/(d*q), ..., H/q]."""

    mode = "2.5d"


class PatchEmbedding2p5D(GridPatchEmbedding):
    """ViT patch embedding on a tp_mode="2.5d" mesh: [B/(d*q), C, img, img] ->
    [B/(d*q), N+1, H/q] (hidden_size divisible by q*q)."""

    mode = "2.5d"
