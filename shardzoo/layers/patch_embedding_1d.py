"""ViT patch embedding for 1D tensor parallelism: replicated, as every 1D activation between blocks.

The serial computation of Hugging Face ``ViTEmbeddings`` (patch_embedding_2d.py) on every tp
rank with the whole parameters, which carry no ShardSpec (replicated), so the names and shapes
of its state dict are the serial ones. Dropout draws from the default stream: every tp rank
holds the same activation and must drop the same elements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.layers.module import ParallelModule
from shardzoo.layers.patch_embedding_2d import check_projection, serial_patch_embedding
from shardzoo.layers.rng_streams import dropout as stream_dropout


def _copy(t: torch.Tensor | None, device) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().to(device, copy=True))


class PatchEmbedding1D(ParallelModule):
    """pixels [b, C, img, img] -> [b, (img/p)^2 + 1, H], replicated over tp.

    Args as ``PatchEmbedding2D`` (image_size, patch_size, in_channels, hidden_size, mesh,
    dropout, dtype, device); ``from_serial`` takes a HF-style ``ViTEmbeddings``."""

    def __init__(self, image_size: int, patch_size: int, in_channels: int, hidden_size: int, *, mesh,
                 dropout: float = 0.0, dtype=None, device=None, placement=None):
        super().__init__()
        serial = serial_patch_embedding(image_size, patch_size, in_channels, hidden_size, dropout, dtype)
        self._setup(serial, mesh, device, image_size=image_size)

    def _setup(self, serial: nn.Module, mesh, device, placement=None, image_size: int | None = None) -> None:
        proj = serial.patch_embeddings.projection
        positions = serial.position_embeddings
        self.mesh = mesh
        self.patch_size, self.in_channels, self.hidden_size = proj.kernel_size[0], proj.in_channels, proj.out_channels
        self.image_size = image_size or int(round((positions.shape[1] - 1) ** 0.5)) * self.patch_size
        self.dropout = getattr(getattr(serial, "dropout", None), "p", 0.0)
        check_projection(type(self).__name__, proj, self.image_size)
        device = device if device is not None else proj.weight.device
        self.cls_token = _copy(serial.cls_token, device)
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(self.in_channels, self.hidden_size, self.patch_size,
                                                     stride=self.patch_size, bias=proj.bias is not None,
                                                     device="meta")
        self.patch_embeddings.projection.weight = _copy(proj.weight, device)
        self.patch_embeddings.projection.bias = _copy(proj.bias, device)
        self.position_embeddings = _copy(positions, device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [b, C, img, img] -> [b, N+1, H]."""
        proj = self.patch_embeddings.projection
        patches = F.conv2d(pixels, proj.weight, proj.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], 1) + self.position_embeddings
        return stream_dropout(x, self.dropout, mesh=self.mesh, parallel_region=False, training=self.training)


    def extra_repr(self) -> str:
        return (f"image_size={self.image_size}, patch_size={self.patch_size}, in_channels={self.in_channels}, "
                f"hidden_size={self.hidden_size}, dropout={self.dropout}")
