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

from shardzoo.testing.dtypes import dtypes
from shardzoo.testing.meshes import batch_parts, hidden_parts, with_world
from shardzoo.testing.pools import cached_mesh

DTYPES = dtypes("fp32", "fp64")
# name -> (ParallelMesh kwargs, world size)
MESHES = {
    "2d": with_world(tp=4, tp_mode="2d"),
    "2d_dp2": with_world(dp=2, tp=4, tp_mode="2d"),
    "2d_sp2": with_world(sp=2, tp=4, tp_mode="2d"),
    "2.5d": with_world(tp=8, tp_mode="2.5d", tp_depth=2),
    "2.5d_d1": with_world(tp=4, tp_mode="2.5d", tp_depth=1),
    "3d": with_world(tp=8, tp_mode="3d"),
}
# name -> parts the batch (dim 0) of an activation is cut into: a batch must be a multiple
BATCH_PARTS = {name: batch_parts(kwargs) for name, (kwargs, _) in MESHES.items()}


def mesh_of(name: str):
    """The cached ``ParallelMesh`` of ``name`` (call it on the ranks)."""
    return cached_mesh(**MESHES[name][0])


def world_of(name: str) -> int:
    """The world size ``name``'s mesh needs."""
    return MESHES[name][1]


def hidden_parts_of(name: str, q: int = 2) -> int:
    """Pieces an H-indexed table is cut into on ``name``'s mode with side ``q``: q*q in 2D /
    2.5D, q^3 in 3D."""
    return hidden_parts(MESHES[name][0]["tp_mode"], q)


def classes(mode: str) -> dict[str, type]:
    """Layer classes of ``mode`` ("2d", "2.5d", "3d") by kind, as the mode's TensorLayout
    builds them (linear, norm, rms_norm, embedding, vocab_embedding, patch_embedding alias
    patch, lm_head, classifier; 2D also linear_2p5d, to test its mesh check)."""
    from shardzoo.layers.linear_2p5d import ParallelLinear2p5D
    from shardzoo.layers.tensor_layout import LAYOUTS

    kinds = dict(LAYOUTS[mode].kinds)
    kinds["patch"] = kinds["patch_embedding"]
    if mode == "2d":
        kinds["linear_2p5d"] = ParallelLinear2p5D
    return kinds


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))): the same code serial and parallel. [..., H] -> [..., H]."""

    def __init__(self, ln: nn.Module, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.ln, self.fc1, self.fc2 = ln, fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def parallel_mlp(serial: MLPBlock, mesh) -> MLPBlock:
    """The twin of a serial ``MLPBlock`` (LayerNorm, Linear, Linear) on ``mesh``, built through
    the mode's factory; it consumes and returns activations in the mesh's canonical placement."""
    from shardzoo.layers.tensor_layout import layout_of

    layout = layout_of(mesh)
    fc1 = layout.linear(serial=serial.fc1, style="column")
    fc2 = layout.linear(serial=serial.fc2, style="row")  # consumes fc1's output placement (3D: swapped)
    assert layout.after(fc2) == layout.activation, "a column / row pair ends in the placement it started from"
    return MLPBlock(layout.norm(serial=serial.ln), fc1, fc2)
