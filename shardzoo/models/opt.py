"""OPT (causal LM) as a plain torch model with its plan; models/planned.py builds and splits it
(the constructor's layout arguments and the usage are in docs/models.md, as for GPT-2):

    model = OPT(OPTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4), ...)
    logits = model(model.shard_input(ids_full))       # [b, s, V_local]

Pre- or post-LayerNorm blocks (``do_layer_norm_before``, False in opt-350m) and
``project_in`` / ``project_out`` when ``word_embed_proj_dim != hidden_size``. Parameter names
are those of ``OPTForCausalLM`` (``model.decoder.layers.{i}.self_attn.q_proj`` ...).
Positions are ``arange(S) + 2`` (OPT's learned-position offset), i.e. right padding or none;
transformers derives them from the attention mask, which differs for left-padded batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.plain import Attention, activation_module
from shardzoo.models.planned import PlannedModel
from shardzoo.models.spec import FamilySpec

POSITION_OFFSET = 2


@dataclass
class OPTConfig(HFConfig):
    """Fields of Hugging Face's OPT ``config.json`` that the model uses."""

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    _remove_final_layer_norm: bool = False
    word_embed_proj_dim: int | None = None
    dropout: float = 0.1
    attention_dropout: float = 0.0
    num_attention_heads: int = 12
    activation_function: str = "relu"
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    pad_token_id: int | None = 1  # null in config.json: no padding row
    tie_word_embeddings: bool = True

    SUPPORTED = {"activation_function": ACTIVATION_NAMES}

    @property
    def embed_dim(self) -> int:
        return self.word_embed_proj_dim or self.hidden_size


class OPTLearnedPositionalEmbedding(nn.Embedding):
    """Learned positions whose first ``offset`` rows are unused (OPT's 2): positions [..., s]
    (0..S-1) -> rows ``positions + offset``, [..., s, H]. The plan's ``position_embedding``
    style reads ``offset`` (shardzoo/parallel/positions.py)."""

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = POSITION_OFFSET):
        super().__init__(num_positions + offset, embedding_dim)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + self.offset)


class OPTDecoderLayer(nn.Module):
    """Pre-LN (``do_layer_norm_before``): x + drop(attn(ln(x))), then x + drop(fc2(relu(fc1(ln(x)))));
    post-LN: ln(x + drop(attn(x))), then ln(x + drop(fc2(relu(fc1(x))))). [b, s, H] -> same."""

    def __init__(self, config: OPTConfig):
        super().__init__()
        h, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = Attention(h, config.num_attention_heads, causal=True, dropout=config.attention_dropout,
                                   bias=config.enable_bias)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.fc1 = nn.Linear(h, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = nn.Linear(config.ffn_dim, h, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.act = activation_module(config.activation_function)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.dropout(self.self_attn(h, key_padding_mask))
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.dropout(self.fc2(self.act(self.fc1(h))))
        return x if self.pre_norm else self.final_layer_norm(x)


OPT_PLAN = {
    "embed_tokens": "vocab_embedding", "embed_positions": "position_embedding", "project_in": "dense",
    "dropout": "dropout", "self_attn_layer_norm": "norm", "final_layer_norm": "norm",
    "self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
    "self_attn.out_proj": "row", "fc1": "column", "fc2": "row", "project_out": "dense", "lm_head": "lm_head",
}


class OPT(PlannedModel):
    """OPT causal LM (one pipeline stage of it with ``stage=``); arguments: models/planned.py.

    Forward (b = batch rows, s = tokens of this stage's input):
        first stage: ids [b, s] -> ...; other stages: hidden [b, s, H] -> ...;
        last stage: ... -> logits [b, s, V]; others: hidden [b, s, H].
    """

    family = "OPT"
    causal = True
    plan = OPT_PLAN

    def build(self, config: OPTConfig, blocks: range) -> None:
        h, e, tie = config.hidden_size, config.embed_dim, config.tie_word_embeddings
        self.tied_names = {"lm_head.weight": "model.decoder.embed_tokens.weight"} if tie else {}
        self.model = nn.Module()
        self.model.decoder = dec = nn.Module()
        if self.is_first:
            dec.embed_tokens = nn.Embedding(config.vocab_size, e, padding_idx=config.pad_token_id)
            dec.embed_positions = OPTLearnedPositionalEmbedding(config.max_position_embeddings, h)
            if e != h:
                dec.project_in = nn.Linear(e, h, bias=False)
            dec.dropout = nn.Dropout(config.dropout)
        dec.layers = nn.ModuleDict({str(i): OPTDecoderLayer(config) for i in blocks})
        if self.is_last:
            if config.do_layer_norm_before and not config._remove_final_layer_norm:
                dec.final_layer_norm = nn.LayerNorm(h, elementwise_affine=config.layer_norm_elementwise_affine)
            if e != h:
                dec.project_out = nn.Linear(h, e, bias=False)
            self.lm_head = nn.Linear(e, config.vocab_size, bias=False)
            if tie and self.is_first:
                self.lm_head.weight = dec.embed_tokens.weight

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H] -> hidden, or logits [b, s, V] (last)."""
        dec = self.model.decoder
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)  # [s]; the table adds OPT's offset
            emb = dec.embed_tokens(x)  # [b, s, E]
            if hasattr(dec, "project_in"):
                emb = dec.project_in(emb)  # [b, s, H]
            x = dec.dropout(emb + dec.embed_positions(positions[None]))
        for block in dec.layers.values():
            x = block(x, key_padding_mask)
        if self.is_last:
            if hasattr(dec, "final_layer_norm"):
                x = dec.final_layer_norm(x)
            if hasattr(dec, "project_out"):
                x = dec.project_out(x)  # [b, s, E]
            x = self.lm_head(x)
        return x


def hf_to_shardzoo(name: str, tensor: torch.Tensor, config: OPTConfig) -> list[tuple[str, torch.Tensor]]:
    """One ``OPTForCausalLM`` state-dict entry -> shardzoo (name, tensor) pairs: the same names."""
    return [(name, tensor)]


def shardzoo_to_hf(name: str, tensor: torch.Tensor, config: OPTConfig) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_shardzoo`."""
    return [(name, tensor)]


def tiny_config(layers: int = 2, vocab: int = 101, ffn: int = 64, dropout: float = 0.0, hidden: int = 32,
                heads: int = 4) -> dict:
    """Constructor arguments of a tiny OPT (16 positions), for tests."""
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_dim=ffn,
                vocab_size=vocab, max_position_embeddings=16, dropout=dropout, attention_dropout=dropout)


# shardzoo plan's presets: published checkpoints' config.json values (name: fields, source)
OPT_PRESETS = {
    "opt-1.3b": (dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32),
                 "facebook/opt-1.3b config.json"),
    "opt-13b": (dict(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40),
                "facebook/opt-13b config.json"),
    "opt-175b": (dict(hidden_size=12288, num_hidden_layers=96, ffn_dim=49152, num_attention_heads=96),
                 "Zhang et al. 2022 (OPT), Table 1: 96 layers, 96 heads, hidden 12288"),
}


OPT_SPEC = FamilySpec("opt", OPT, OPTConfig, model_type="opt", architecture="OPTForCausalLM", base_prefix="model.",
                      head_prefixes=("lm_head.",), hf_to_shardzoo=hf_to_shardzoo, shardzoo_to_hf=shardzoo_to_hf,
                      tiny_config=tiny_config, presets=OPT_PRESETS)
