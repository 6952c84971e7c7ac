"""ViT image classification on any layout, whole or as one pipeline stage.

Pixels are split along the batch like the activations; the N+1 tokens (cls + patches) are
made on every sp rank, padded to a multiple of sp (padding masked out of attention) and each
sp rank keeps its contiguous chunk; the cls token (sp rank 0) is broadcast over sp for the
classifier. Parameter names follow ``ViTForImageClassification`` except inside blocks
(``vit.encoder.layer.{i}``): ``attention.q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``,
``mlp.fc1`` / ``mlp.fc2`` (``hf_to_shardzoo``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.layers import replicas
from shardzoo.layers.attention import SelfAttention, check_heads
from shardzoo.layers.mlp import MLP
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.pipeline import StagedModel
from shardzoo.models.spec import FamilySpec


@dataclass
class ViTConfig(HFConfig):
    """Fields of Hugging Face's ViT ``config.json`` that the model uses (``num_labels`` comes
    from ``id2label`` when read from JSON)."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-12
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    num_labels: int = 2

    SUPPORTED = {"hidden_act": ACTIVATION_NAMES}

    @classmethod
    def fields_from(cls, data):
        # config.json stores the labels, not their count (transformers derives num_labels from id2label)
        fields = super().fields_from(data)
        if data.get("id2label"):
            fields["num_labels"] = len(data["id2label"])
        return fields

    @property
    def num_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


class ViTEmbeddings(nn.Module):
    """cat(cls, patches) + positions, the serial twin every layout's patch embedding is cut
    from: pixels [B, C, img, img] -> [B, N+1, H]."""

    def __init__(self, config: ViTConfig, device=None):
        super().__init__()
        h, n = config.hidden_size, config.num_tokens
        self.cls_token = nn.Parameter(torch.randn(1, 1, h, device=device))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(config.num_channels, h, config.patch_size,
                                                     stride=config.patch_size, device=device)
        self.position_embeddings = nn.Parameter(torch.randn(1, n, h, device=device))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], 1) + self.position_embeddings


class ViTLayer(nn.Module):
    """Pre-LN block: x + attn(layernorm_before(x)), then + mlp(layernorm_after(x))."""

    def __init__(self, config: ViTConfig, mesh, sp_mode: str, device=None):
        super().__init__()
        h, eps, tpl = config.hidden_size, config.layer_norm_eps, layout_of(mesh)
        self.mesh, self.p = mesh, config.hidden_dropout_prob
        self.layernorm_before = tpl.norm(h, eps, device=device)
        self.attention = SelfAttention(h, config.num_attention_heads, mesh=mesh, causal=False, bias=config.qkv_bias,
                                       attn_dropout=config.attention_probs_dropout_prob, sp_mode=sp_mode,
                                       qkv="separate", device=device)
        self.layernorm_after = tpl.norm(h, eps, device=device)
        self.mlp = MLP(h, config.intermediate_size, mesh=mesh, act=config.hidden_act, device=device)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self._drop(self.attention(self.layernorm_before(x), key_padding_mask))
        return x + self._drop(self.mlp(self.layernorm_after(x)))

    def _drop(self, x):
        return layout_of(self.mesh).dropout(x, self.p, self.training)


class ViT(StagedModel):
    """ViT for image classification on ``mesh`` (arguments as :class:`GPT2`).

    Forward: pixels [b, C, img, img] (first stage) or hidden [b, s, H_l] -> hidden, or on the
    last stage logits [b, num_labels]; s = ceil((N+1)/sp) tokens per sp rank."""

    head_name = "classifier"

    def __init__(self, config: ViTConfig, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, device=None, seed: int | None = None):
        super().__init__()
        with self.building(device, seed) as device:  # meta: shapes only, then this rank's shards
            check_heads("ViT", config.hidden_size, config.num_attention_heads, mesh, sp_mode)
            self.config, self.mesh, self.checkpointing = config, mesh, checkpointing
            tpl = layout_of(mesh)
            self.layout = tpl.activation
            self.tied_names = {}
            blocks, self.is_first, self.is_last = common.stage_blocks("ViT", config.num_hidden_layers, stage,
                                                                      stage_layers)
            self.local_tokens = math.ceil(config.num_tokens / mesh.sp_size)
            h = config.hidden_size
            self.vit = nn.Module()
            if self.is_first:
                self.vit.embeddings = tpl.patch_embedding(config.image_size, serial=ViTEmbeddings(config),
                                                          device=device)
            self.vit.encoder = nn.Module()
            self.vit.encoder.layer = nn.ModuleDict({str(i): ViTLayer(config, mesh, sp_mode, device) for i in blocks})
            if self.is_last:
                self.vit.layernorm = tpl.norm(h, config.layer_norm_eps, device=device)
                self.classifier = tpl.classifier(h, config.num_labels, device=device)
                self.target_layout = self.layout

    def token_mask(self, rows: int, device=None) -> torch.Tensor | None:
        """Bool [rows, s] key mask of this sp rank's tokens (False on the sequence padding)."""
        if self.local_tokens * self.mesh.sp_size == self.config.num_tokens:
            return None
        start = self.mesh.sp_rank * self.local_tokens
        positions = torch.arange(start, start + self.local_tokens, device=device)
        return (positions < self.config.num_tokens)[None].expand(rows, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        mask = self.token_mask(x.shape[0], x.device)
        for block in self.vit.encoder.layer.values():
            x = self.run_block(block, x, mask)
        if not self.is_last:
            return x
        return self.classifier(self.tpl.first_token(self.vit.layernorm(x)))  # the cls token

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [b, C, img, img] -> this sp rank's tokens [b, s, H_l] (padded at the end)."""
        x = self.vit.embeddings(pixels)
        x = self.tpl.dropout(x, self.config.hidden_dropout_prob, self.training)
        pad = self.local_tokens * self.mesh.sp_size - x.shape[1]
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        # plain slicing: each sp rank's gradient covers its own tokens, as for token inputs
        return x.narrow(1, self.mesh.sp_rank * self.local_tokens, self.local_tokens)

    def shard_input(self, pixels_full: torch.Tensor) -> torch.Tensor:
        """Pixels [B, C, img, img] -> this rank's batch rows [b, C, img, img]; the same on every
        tp and sp rank of a dp replica, checked with ``SHARDZOO_DEBUG=1`` (as the token models)."""
        if replicas.debug_mode():
            replicas.check_same_input(pixels_full, self.mesh, f"{type(self).__name__}.shard_input")
        return self.tpl.shard_batch(pixels_full, self.layout)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """Logits [b, num_labels] -> [B, num_labels] (last stage); hidden states otherwise."""
        if self.is_last:
            return self.tpl.gather_batch(y_local, self.layout)
        y = self.tpl.gather_sequence(self.tpl.gather_hidden(y_local, self.layout), 1)
        return y[:, : self.config.num_tokens]

    @property
    def target_axes(self) -> tuple[str, ...]:
        """dp and the classifier's batch axes: every sp rank holds the logits of the same images
        (the cls token is broadcast over sp), so the labels are not split over sp."""
        return ("dp",) + tuple(getattr(self.target_layout, "batch_axes", ()))

    def per_target_loss(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        label_smoothing: float) -> torch.Tensor:
        """Per-image cross entropy of logits [b, C] (full over the classes) against labels [b]."""
        return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="none")


# checkpoint-file names (all transformers versions) -> shardzoo; transformers >= 5 names its
# in-memory modules ``vit.layers.{i}.attention.{q,k,v,o}_proj`` / ``mlp.fc1`` / ``mlp.fc2``
_BLOCK = [("attention.attention.query", "attention.q_proj"), ("attention.attention.key", "attention.k_proj"),
          ("attention.attention.value", "attention.v_proj"), ("attention.output.dense", "attention.out_proj"),
          ("intermediate.dense", "mlp.fc1"), ("output.dense", "mlp.fc2")]
_HF5 = {"attention.o_proj": "attention.out_proj"}
_LAYER = re.compile(r"^(vit\.encoder\.layer\.\d+)\.(.+)\.(weight|bias)$")
_LAYER_HF5 = re.compile(r"^vit\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_to_shardzoo(name: str, tensor: torch.Tensor, config: ViTConfig) -> list[tuple[str, torch.Tensor]]:
    """One ``ViTForImageClassification`` entry (checkpoint-file names, or transformers 5's
    in-memory ``vit.layers.{i}...`` names) -> shardzoo (name, tensor) pairs (pooler dropped)."""
    if name.startswith("vit.pooler."):
        return []
    m = _LAYER_HF5.match(name)
    if m:
        return [(f"vit.encoder.layer.{m.group(1)}.{_HF5.get(m.group(2), m.group(2))}.{m.group(3)}", tensor)]
    renamed = common.rename_block_param(name, _LAYER, _BLOCK, to_ours=True)
    return [(renamed or name, tensor)]


def shardzoo_to_hf(name: str, tensor: torch.Tensor, config: ViTConfig) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_shardzoo`, to the checkpoint-file names (which every
    transformers version loads)."""
    renamed = common.rename_block_param(name, _LAYER, _BLOCK, to_ours=False)
    return [(renamed or name, tensor)]


def tiny_config(layers: int = 2, vocab: int = 0, ffn: int = 64, dropout: float = 0.0, hidden: int = 32,
                heads: int = 4) -> dict:
    """Constructor arguments of a tiny ViT (8x8 images in 4x4 patches, 3 labels), for tests;
    ``vocab`` is ignored (images have none)."""
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
                image_size=8, patch_size=4, num_labels=3, hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout)


VIT_SPEC = FamilySpec("vit", ViT, ViTConfig, model_type="vit", architecture="ViTForImageClassification",
                      base_prefix="vit.", head_prefixes=("classifier.",), hf_to_shardzoo=hf_to_shardzoo,
                      shardzoo_to_hf=shardzoo_to_hf, tiny_config=tiny_config)
