"""ViT image classification as a plain torch model with its plan; models/planned.py builds and
splits it (the constructor's layout arguments and the usage are in docs/models.md):

    model = ViT(ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4), ...)
    pixels = model.shard_input(pixels_full)          # [B, C, img, img] -> [b, C, img, img]
    logits = model(pixels)                           # [b, num_labels]
    loss = model.loss(logits, model.shard_target(labels_full))
    full = model.gather_output(logits)               # [B, num_labels]

The plan splits it: the embeddings ('patch_embedding') make the N+1 tokens (cls + patches) and,
under sequence parallelism, keep this rank's chunk of them padded to a multiple of the ranks,
the padding masked out of attention; the classifier's ``x[:, 0]`` ('first_token') reads the
cls token wherever it lives. Parameter names follow ``ViTForImageClassification`` except inside
blocks (``vit.encoder.layer.{i}``): ``attention.q_proj`` / ``k_proj`` / ``v_proj`` /
``out_proj``, ``mlp.fc1`` / ``mlp.fc2`` (``hf_to_shardzoo``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.plain import MLP, Attention
from shardzoo.models.planned import PlannedModel
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
    """cat(cls, patches) + positions, then dropout (Hugging Face's ``ViTEmbeddings`` without mask
    token or interpolation): pixels [b, C, img, img] -> [b, N+1, H]."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.cls_token = nn.Parameter(torch.randn(1, 1, h))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(config.num_channels, h, p, stride=p)
        self.position_embeddings = nn.Parameter(torch.randn(1, config.num_tokens, h))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)  # [b, N, H]
        cls = self.cls_token.expand(patches.shape[0], -1, -1)  # [b, 1, H]
        return self.dropout(torch.cat([cls, patches], 1) + self.position_embeddings)  # [b, N+1, H]


class ViTLayer(nn.Module):
    """Pre-LN block: x + drop(attn(layernorm_before(x))), then + drop(mlp(layernorm_after(x))).
    [b, s, H] -> same."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.layernorm_before = nn.LayerNorm(h, eps=eps)
        # qkv_bias covers out_proj too, as shardzoo's ViT always had (its checkpoints' names)
        self.attention = Attention(config.hidden_size, config.num_attention_heads, causal=False,
                                   dropout=config.attention_probs_dropout_prob, bias=config.qkv_bias)
        self.layernorm_after = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.drop = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attention(self.layernorm_before(x), key_padding_mask))
        return x + self.drop(self.mlp(self.layernorm_after(x)))


class FirstToken(nn.Module):
    """The cls token: x [b, s, H] -> x[:, 0], [b, H]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0]


VIT_PLAN = {
    "vit.embeddings": "patch_embedding",
    "layernorm_before": "norm", "layernorm_after": "norm", "vit.layernorm": "norm", "drop": "dropout",
    "attention.q_proj": "column", "attention.k_proj": "column", "attention.v_proj": "column",
    "attention.out_proj": "row", "mlp.fc1": "column", "mlp.fc2": "row",
    "cls_token_of": "first_token", "classifier": "classifier",
}


class ViT(PlannedModel):
    """ViT for image classification (one pipeline stage of it with ``stage=``); arguments:
    models/planned.py.

    Forward (b = batch rows, s = tokens of this stage's input):
        first stage: pixels [b, C, img, img] -> ...; other stages: hidden [b, s, H] -> ...;
        last stage: ... -> logits [b, num_labels]; others: hidden [b, s, H].
    """

    family = "ViT"
    causal = False
    plan = VIT_PLAN
    positions_field = None
    head_name = "classifier"
    tied_names: dict[str, str] = {}
    pooled_head = True  # labels [B], one per image

    @staticmethod
    def own_sequence_length(config: ViTConfig) -> int:
        return config.num_tokens

    @classmethod
    def example_input(cls, config: ViTConfig, rows: int, tokens: int) -> torch.Tensor:
        """Pixels [rows, C, img, img] (the tokens come from the image)."""
        return torch.zeros(rows, config.num_channels, config.image_size, config.image_size)

    def build(self, config: ViTConfig, blocks: range) -> None:
        self.vit = nn.Module()
        if self.is_first:
            self.vit.embeddings = ViTEmbeddings(config)
        self.vit.encoder = nn.Module()
        self.vit.encoder.layer = nn.ModuleDict({str(i): ViTLayer(config) for i in blocks})
        if self.is_last:
            self.vit.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.cls_token_of = FirstToken()
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """pixels [b, C, img, img] (first stage) or hidden [b, s, H] -> hidden, or logits
        [b, num_labels] (last)."""
        if self.is_first:
            x = self.vit.embeddings(x)  # [b, N+1, H]
        for block in self.vit.encoder.layer.values():
            x = block(x, key_padding_mask)
        if self.is_last:
            x = self.classifier(self.cls_token_of(self.vit.layernorm(x)))  # [b, num_labels]
        return x


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


# shardzoo plan's presets: published checkpoints' config.json values (name: fields, source)
VIT_PRESETS = {
    "vit-base": (dict(num_labels=1000), "google/vit-base-patch16-224 config.json"),
    "vit-huge": (dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                      patch_size=14, num_labels=21843), "google/vit-huge-patch14-224-in21k config.json"),
}


VIT_SPEC = FamilySpec("vit", ViT, ViTConfig, model_type="vit", architecture="ViTForImageClassification",
                      base_prefix="vit.", head_prefixes=("classifier.",), hf_to_shardzoo=hf_to_shardzoo,
                      shardzoo_to_hf=shardzoo_to_hf, tiny_config=tiny_config, presets=VIT_PRESETS)
