"""ViT patch embedding on the 2D layout (and the base of the 2.5D / 3D ones).

Equal to Hugging Face ``ViTEmbeddings`` (no mask token, no position interpolation):

    patches = Conv2d(C, H, kernel_size=p, stride=p)(pixels).flatten(2).transpose(1, 2)  # [B, N, H]
    x = cat([cls_token.expand(B, 1, H), patches], 1) + position_embeddings              # [B, N+1, H]
    x = dropout(x)

Pixels [B, C, img, img] are split along the batch only (``shard_input``); every tensor indexed
by H (conv weight and bias along the output channels, cls token, position embeddings) is split
like an embedding table: q * size(param_axes) chunks, gathered over ``param_axes`` in forward
into this rank's hidden block, so the output is [B/parts, N+1, H/q] in the layer's placement.
Dropout draws from the per-tp-rank stream (layers/rng_streams.py): every rank holds a distinct block.
Parameter names follow ``ViTEmbeddings`` (``cls_token``, ``position_embeddings``,
``patch_embeddings.projection.weight`` / ``.bias``), so ``full_state_dict`` loads into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo import comm
from shardzoo.layers import placements
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.rng_streams import dropout as stream_dropout

# (owner path, name, hidden dim); names follow HF ViTEmbeddings so full_state_dict loads into it
_PARAMS = (("patch_embeddings.projection", "weight", 0), ("patch_embeddings.projection", "bias", 0),
           ("", "cls_token", -1), ("", "position_embeddings", -1))


def serial_patch_embedding(image_size: int, patch_size: int, in_channels: int, hidden_size: int,
                           dropout: float = 0.0, dtype=None) -> nn.Module:
    """A fresh serial twin with the draws of HF ViTEmbeddings.__init__, in its order (cls token,
    projection, positions), on CPU; ``from_serial`` of any patch embedding takes it."""
    serial = nn.Module()
    serial.cls_token = nn.Parameter(torch.randn(1, 1, hidden_size, dtype=dtype))
    serial.patch_embeddings = nn.Module()
    serial.patch_embeddings.projection = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size,
                                                   dtype=dtype, device="cpu")
    num_patches = (image_size // patch_size) ** 2
    serial.position_embeddings = nn.Parameter(torch.randn(1, num_patches + 1, hidden_size, dtype=dtype))
    serial.dropout = nn.Dropout(dropout)
    return serial


def check_projection(who: str, proj: nn.Conv2d, image_size: int) -> None:
    """Raise unless ``proj`` cuts non-overlapping square patches that tile the image."""
    if proj.kernel_size != proj.stride or proj.kernel_size[0] != proj.kernel_size[1]:
        raise ValueError(f"{who} needs a square projection with kernel_size == stride (non-overlapping "
                         f"patches); got kernel_size={proj.kernel_size}, stride={proj.stride}. Build the "
                         f"Conv2d with kernel_size=stride=patch_size")
    placements.check_divisible(who, "image_size", image_size, proj.kernel_size[0], f"patch_size={proj.kernel_size[0]}")


class _Holder(nn.Module):
    """Parameter owner that carries the mesh (full_state_dict finds shards through it)."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh


class GridPatchEmbedding(placements.GridModule):
    """Patch projection + cls token + position embeddings; pixels [B/parts, C, img, img] ->
    [B/parts, (img/p)^2 + 1, H/q]. H must be divisible by q * size(param_axes)."""

    def __init__(self, image_size: int, patch_size: int, in_channels: int, hidden_size: int, *, mesh,
                 dropout: float = 0.0, dtype=None, device=None, placement: ActivationPlacement | None = None):
        super().__init__()
        serial = serial_patch_embedding(image_size, patch_size, in_channels, hidden_size, dropout, dtype)
        self._setup(serial, mesh, device, placement=placement, image_size=image_size)

    def _setup(self, serial: nn.Module, mesh, device, placement: ActivationPlacement | None = None,
               image_size: int | None = None) -> None:
        """``serial``: a HF-style ``ViTEmbeddings`` (``cls_token``, ``position_embeddings``,
        ``patch_embeddings.projection``: nn.Conv2d, optional ``dropout``)."""
        proj, cls_token, positions = serial.patch_embeddings.projection, serial.cls_token, serial.position_embeddings
        image_size = image_size or int(round((positions.shape[1] - 1) ** 0.5)) * proj.kernel_size[0]
        dropout = getattr(getattr(serial, "dropout", None), "p", 0.0)
        self._bind(mesh, placement)
        name = type(self).__name__
        self.patch_size, self.in_channels, self.hidden_size = proj.kernel_size[0], proj.in_channels, proj.out_channels
        self.image_size, self.dropout = image_size, dropout
        check_projection(name, proj, image_size)
        placements.check_hidden_parts(name, "hidden_size", self.hidden_size, mesh, self.placement)
        self.patch_embeddings = _Holder(mesh)
        self.patch_embeddings.projection = _Holder(mesh)
        full = {"weight": proj.weight, "bias": proj.bias, "cls_token": cls_token, "position_embeddings": positions}
        for owner, pname, dim in _PARAMS:
            module = self.get_submodule(owner)
            if full[pname] is None:
                module.register_parameter(pname, None)
            else:
                placements.hidden_param(module, pname, full[pname], dim, mesh, self.placement, device)

    def _gathered(self, owner: str, name: str, dim: int):
        p = getattr(self.get_submodule(owner), name)
        return None if p is None else placements.gather_hidden_param(p, dim, self.mesh, self.placement)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B/parts, C, img, img] -> [B/parts, N+1, H/q]."""
        if tuple(pixels.shape[1:]) != (self.in_channels, self.image_size, self.image_size):
            raise ValueError(f"{type(self).__name__} expects pixels [batch, {self.in_channels}, {self.image_size}, "
                             f"{self.image_size}] (in_channels, image_size of the layer); got {tuple(pixels.shape)}. "
                             f"Resize the images, or build the layer with image_size / in_channels of the data")
        weight, bias, cls_token, positions = (self._gathered(o, n, d) for o, n, d in _PARAMS)
        # every rank of the hidden group projects the same pixels onto its own channels
        pixels = comm.copy_to(pixels, self.mesh.group(self.placement.hidden_axis))
        patches = F.conv2d(pixels, weight, bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([cls_token.expand(patches.shape[0], -1, -1), patches], 1) + positions
        return stream_dropout(x, self.dropout, mesh=self.mesh, training=self.training)

    def shard_input(self, pixels_full: torch.Tensor) -> torch.Tensor:
        """Pixels [B, C, img, img] (replicated) -> this rank's batch block [B/parts, C, img, img]."""
        return placements.shard_batch(pixels_full, self.mesh, self.placement, type(self).__name__)

    def extra_repr(self) -> str:
        return (f"image_size={self.image_size}, patch_size={self.patch_size}, in_channels={self.in_channels}, "
                f"hidden_size={self.hidden_size}, dropout={self.dropout}, placement=({self.placement})")


class PatchEmbedding2D(GridPatchEmbedding):
    """ViT patch embedding on a tp_mode="2d" mesh: [B/q, C, img, img] -> [B/q, N+1, H/q]
    (hidden_size divisible by q*q)."""

    mode = "2d"
