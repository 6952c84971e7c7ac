"""The embedding styles: 'vocab_embedding' (the token table, split along the vocabulary),
'embedding' (a small table whose output follows the activation placement; replicated in 1d),
'position_embedding' (an 'embedding' indexed by local positions, mapped to this rank's global
ones under sp: positions.py) and 'patch_embedding' (a ViTEmbeddings-like module making the
tokens from pixels: patch_embedding.py). ids [b, s] (pixels [b, C, img, img]) -> [b, s, H_l].
"""

from __future__ import annotations

from torch import nn

from shardzoo.layers.embedding_1d import VocabParallelEmbedding1D
from shardzoo.layers.embedding_2d import Embedding2D, VocabParallelEmbedding2D
from shardzoo.layers.embedding_2p5d import Embedding2p5D, PatchEmbedding2p5D, VocabParallelEmbedding2p5D
from shardzoo.layers.embedding_3d import Embedding3D, PatchEmbedding3D, VocabParallelEmbedding3D
from shardzoo.layers.patch_embedding_1d import PatchEmbedding1D
from shardzoo.layers.patch_embedding_2d import PatchEmbedding2D
from shardzoo.parallel import hf_model
from shardzoo.parallel.patch_embedding import build_patch_embedding, check_patch_embedding
from shardzoo.parallel.positions import build_position_embedding
from shardzoo.parallel.styles.base import Build, Layer, Style, Whole, canonical


class Table(Style):
    """An ``nn.Embedding`` planned as a table of this style."""

    needs = "an nn.Embedding"

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Embedding)


class VocabEmbedding(Table):
    """The token table split along the vocabulary (and the hidden in the grids)."""

    name = "vocab_embedding"
    builds_first = True  # a tied 'lm_head' is built on this layer
    layers = {"1d": Layer(VocabParallelEmbedding1D), "2d": Layer(VocabParallelEmbedding2D, canonical),
              "2.5d": Layer(VocabParallelEmbedding2p5D, canonical), "3d": Layer(VocabParallelEmbedding3D, canonical)}


class Embedding(Table):
    """A small table (positions, token types) whose output follows the activation placement."""

    name = "embedding"
    layers = {"1d": Layer(Whole), "2d": Layer(Embedding2D, canonical), "2.5d": Layer(Embedding2p5D, canonical),
              "3d": Layer(Embedding3D, canonical)}


class PositionEmbedding(Embedding):
    """An 'embedding' indexed by the positions 0..S-1 of the tokens a rank sees (positions.py)."""

    name = "position_embedding"

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        if ctx.mesh.sp_size > 1 and hf_model.is_transformers_model(ctx.model):
            raise ValueError(f"{ctx.name} is planned 'position_embedding', but {type(ctx.model).__name__} is a "
                             f"transformers model, whose position_ids the input hook already makes global under "
                             f"sp; plan it 'embedding'")
        return build_position_embedding(module, ctx.mesh, ctx.zigzag, lambda table: self.layer(table, ctx),
                                        ctx.name)


class PatchEmbedding(Style):
    """A ViTEmbeddings-like module: pixels -> cls token + patches + positions (patch_embedding.py)."""

    name = "patch_embedding"
    needs = ("a ViTEmbeddings-like module: patch_embeddings.projection (nn.Conv2d), cls_token [1, 1, H] and "
             "position_embeddings [1, T, H]")
    layers = {mode: Layer(cls, lambda ctx: {"placement": ctx.layout.activation, "image_size": None})
              for mode, cls in (("1d", PatchEmbedding1D), ("2d", PatchEmbedding2D), ("2.5d", PatchEmbedding2p5D),
                                ("3d", PatchEmbedding3D))}

    def check(self, name: str, module: nn.Module, pattern: str) -> None:
        check_patch_embedding(name, module, pattern)

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        make = lambda serial: self.layer(serial, ctx, device=module.cls_token.device)  # noqa: E731
        return build_patch_embedding(module, ctx.mesh, ctx.model, ctx.zigzag, make)
