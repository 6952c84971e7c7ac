"""OPT (causal LM) on any layout, whole or as one pipeline stage; pre- or post-LayerNorm blocks
(``do_layer_norm_before``, False in opt-350m) and ``project_in`` / ``project_out`` when
``word_embed_proj_dim != hidden_size``.

Parameter names are those of ``OPTForCausalLM`` (``model.decoder.layers.{i}.self_attn.q_proj``
...). Positions are ``arange(S) + 2`` (OPT's learned-position offset), i.e. right padding or
none; HF derives positions from the attention mask, which differs for left-padded batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardzoo.layers import attention_tp as tpl
from shardzoo.layers import random
from shardzoo.layers.attention import SelfAttention, check_heads
from shardzoo.layers.attention_core import local_positions
from shardzoo.layers.mlp import activation
from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.pipeline import StagedModel

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


class OPTDecoderLayer(nn.Module):
    """x + attn(ln(x)) / ln(x + attn(x)) per ``do_layer_norm_before``, then the same for the MLP."""

    def __init__(self, config: OPTConfig, mesh, sp_mode: str, device=None):
        super().__init__()
        h, layout = config.hidden_size, tpl.input_layout(mesh)
        self.mesh, self.pre_norm, self.p = mesh, config.do_layer_norm_before, config.dropout
        self.act = activation(config.activation_function)
        affine = config.layer_norm_elementwise_affine
        self.self_attn = SelfAttention(h, config.num_attention_heads, mesh=mesh, causal=True,
                                       bias=config.enable_bias, attn_dropout=config.attention_dropout,
                                       sp_mode=sp_mode, qkv="separate", device=device)
        self.self_attn_layer_norm = tpl.tp_layer_norm(nn.LayerNorm(h, elementwise_affine=affine), mesh, layout, device)
        self.fc1 = tpl.tp_linear(nn.Linear(h, config.ffn_dim, config.enable_bias), mesh, layout, "column", device)
        self.fc2 = tpl.tp_linear(nn.Linear(config.ffn_dim, h, config.enable_bias), mesh,
                                 tpl.layout_after(self.fc1, layout), "row", device)
        self.final_layer_norm = tpl.tp_layer_norm(nn.LayerNorm(h, elementwise_affine=affine), mesh, layout, device)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s, H_l] -> same."""
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self._drop(self.self_attn(h, key_padding_mask))
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self._drop(self.fc2(self.act(self.fc1(h))))
        return x if self.pre_norm else self.final_layer_norm(x)

    def _drop(self, x):
        return random.dropout(x, self.p, mesh=self.mesh, parallel_region=self.mesh.tp_mode != "1d",
                              training=self.training)


class OPT(StagedModel):
    """OPT causal LM on ``mesh`` (arguments and stage inputs / outputs as :class:`GPT2`)."""

    causal = True

    def __init__(self, config: OPTConfig, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, device=None, seed: int | None = None):
        super().__init__()
        with self.building(device, seed) as device:  # meta: shapes only, then this rank's shards
            check_heads("OPT", config.hidden_size, config.num_attention_heads, mesh, sp_mode)
            self.config, self.mesh, self.checkpointing = config, mesh, checkpointing
            self.layout = tpl.input_layout(mesh)
            tied = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
            self.tied_names = tied if config.tie_word_embeddings else {}
            blocks, self.is_first, self.is_last = common.stage_blocks("OPT", config.num_hidden_layers, stage,
                                                                      stage_layers)
            h, e = config.hidden_size, config.embed_dim
            self.model = nn.Module()
            self.model.decoder = dec = nn.Module()
            if self.is_first:
                dec.embed_tokens = common.vocab_embedding(nn.Embedding(config.vocab_size, e, config.pad_token_id), mesh,
                                                          self.layout, device)
                dec.embed_positions = common.hidden_embedding(
                    nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, h), mesh, self.layout, device)
                if e != h:
                    dec.project_in = common.dense(nn.Linear(e, h, bias=False), mesh, self.layout, device)
            dec.layers = nn.ModuleDict({str(i): OPTDecoderLayer(config, mesh, sp_mode, device) for i in blocks})
            if self.is_last:
                if config.do_layer_norm_before and not config._remove_final_layer_norm:
                    dec.final_layer_norm = tpl.tp_layer_norm(
                        nn.LayerNorm(h, elementwise_affine=config.layer_norm_elementwise_affine), mesh, self.layout,
                        device)
                if e != h:
                    dec.project_out = common.dense(nn.Linear(h, e, bias=False), mesh, self.layout, device)
                tie = dec.embed_tokens if self.is_first and config.tie_word_embeddings else None
                serial = None if tie is not None else nn.Linear(e, config.vocab_size, bias=False)
                self.lm_head = common.lm_head(e, config.vocab_size, mesh, self.layout, tie_to=tie, serial=serial,
                                              device=device)
                self.target_layout = common.head_output_layout(self.lm_head, self.layout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H_l] -> hidden, or logits [b, s, V_local] (last)."""
        dec = self.model.decoder
        if self.is_first:
            common.check_seq_len("OPT", x.shape[1] * self.mesh.sp_size, self.config.max_position_embeddings,
                                 "max_position_embeddings")
            positions = local_positions(x.shape[1], self.mesh, zigzag=True, device=x.device) + POSITION_OFFSET
            emb = dec.embed_tokens(x)
            if hasattr(dec, "project_in"):
                emb = common.run_dense(dec.project_in, emb, self.mesh, self.layout)
            x = emb + dec.embed_positions(positions[None])
            x = random.dropout(x, self.config.dropout, mesh=self.mesh, parallel_region=self.mesh.tp_mode != "1d",
                               training=self.training)
        for block in dec.layers.values():
            x = self.run_block(block, x, key_padding_mask)
        if self.is_last:
            if hasattr(dec, "final_layer_norm"):
                x = dec.final_layer_norm(x)
            if hasattr(dec, "project_out"):
                x = common.run_dense(dec.project_out, x, self.mesh, self.layout)
            x = self.lm_head(x)
        return x


def hf_to_shardzoo(name: str, tensor: torch.Tensor, config: OPTConfig) -> list[tuple[str, torch.Tensor]]:
    """One ``OPTForCausalLM`` state-dict entry -> shardzoo (name, tensor) pairs: the same names."""
    return [(name, tensor)]


def shardzoo_to_hf(name: str, tensor: torch.Tensor, config: OPTConfig) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_shardzoo`."""
    return [(name, tensor)]
