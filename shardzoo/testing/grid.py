"""The named meshes the 2D / 2.5D / 3D layers are tested on, their layer classes, and a
transformer MLP block built from its serial twin in any of these modes.

Names are plain strings so that a test can parametrize over them and send them to the ranks:

    @pytest.mark.parametrize("name", ["2d", "2d_dp2", "2.5d", "3d"])
    def test_mine(name):
        run_on_ranks(check_mine, world_of(name), name)   # check_mine calls mesh_of(name)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.testing.pools import cached_mesh

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# name -> (ParallelMesh kwargs, world size)
MESHES = {
    "2d": (dict(tp=4, tp_mode="2d"), 4),
    "2d_dp2": (dict(dp=2, tp=4, tp_mode="2d"), 8),
    "2d_sp2": (dict(sp=2, tp=4, tp_mode="2d"), 8),
    "2.5d": (dict(tp=8, tp_mode="2.5d", tp_depth=2), 8),
    "2.5d_d1": (dict(tp=4, tp_mode="2.5d", tp_depth=1), 4),
    "3d": (dict(tp=8, tp_mode="3d"), 8),
}
# name -> parts the batch (dim 0) of an activation is cut into: a batch must be a multiple
BATCH_PARTS = {"2d": 2, "2d_dp2": 2, "2d_sp2": 2, "2.5d": 4, "2.5d_d1": 2, "3d": 4}


def mesh_of(name: str):
    """The cached ``ParallelMesh`` of ``name`` (call it on the ranks)."""
    return cached_mesh(**MESHES[name][0])


def world_of(name: str) -> int:
    """The world size ``name``'s mesh needs."""
    return MESHES[name][1]


def hidden_parts_of(name: str, q: int = 2) -> int:
    """Pieces an H-indexed table is cut into: q*q in 2D / 2.5D, q^3 in 3D."""
    return q**3 if name == "3d" else q * q


def classes(mode: str) -> dict[str, type]:
    """Layer classes of ``mode`` ("2d", "2.5d", "3d") by kind: linear, norm, embedding,
    vocab_embedding, classifier, lm_head, patch (2D also linear_2p5d, to test its mesh check)."""
    from shardzoo.layers import (embedding_2d, embedding_2p5d, embedding_3d, head_2d, head_2p5d, head_3d,
                                 linear_2d, linear_2p5d, linear_3d, norm_2d, norm_2p5d, norm_3d, patch_embedding_2d)

    if mode == "2d":
        return dict(linear=linear_2d.ParallelLinear2D, norm=norm_2d.LayerNorm2D, embedding=embedding_2d.Embedding2D,
                    vocab_embedding=embedding_2d.VocabParallelEmbedding2D, classifier=head_2d.Classifier2D,
                    lm_head=head_2d.LMHead2D, patch=patch_embedding_2d.PatchEmbedding2D,
                    linear_2p5d=linear_2p5d.ParallelLinear2p5D)
    if mode == "2.5d":
        return dict(linear=linear_2p5d.ParallelLinear2p5D, norm=norm_2p5d.LayerNorm2p5D,
                    embedding=embedding_2p5d.Embedding2p5D, vocab_embedding=embedding_2p5d.VocabParallelEmbedding2p5D,
                    classifier=head_2p5d.Classifier2p5D, lm_head=head_2p5d.LMHead2p5D,
                    patch=embedding_2p5d.PatchEmbedding2p5D)
    return dict(linear=linear_3d.ParallelLinear3D, norm=norm_3d.LayerNorm3D, embedding=embedding_3d.Embedding3D,
                vocab_embedding=embedding_3d.VocabParallelEmbedding3D, classifier=head_3d.Classifier3D,
                lm_head=head_3d.LMHead3D, patch=embedding_3d.PatchEmbedding3D)


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))): the same code serial and parallel. [..., H] -> [..., H]."""

    def __init__(self, ln: nn.Module, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.ln, self.fc1, self.fc2 = ln, fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def parallel_mlp(serial: MLPBlock, mesh) -> MLPBlock:
    """The grid-mode twin of a serial ``MLPBlock`` (LayerNorm, Linear, Linear) on ``mesh``;
    it consumes and returns activations in the mesh's canonical layout."""
    from shardzoo.layers import layouts

    kinds = classes(mesh.tp_mode)
    fc1 = kinds["linear"].from_serial(serial.fc1, mesh)
    if mesh.tp_mode == "3d":  # fc2 consumes fc1's layout; its output is back in the canonical one
        fc2 = kinds["linear"].from_serial(serial.fc2, mesh, input_layout=fc1.output_layout)
        assert fc2.output_layout == layouts.canonical_layout(mesh)
    else:
        fc2 = kinds["linear"].from_serial(serial.fc2, mesh)
    return MLPBlock(kinds["norm"].from_serial(serial.ln, mesh), fc1, fc2)
