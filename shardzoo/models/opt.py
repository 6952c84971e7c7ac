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

from shardzoo.layers.attention import SelfAttention, check_heads
from shardzoo.layers.attention_core import local_positions
from shardzoo.layers.mlp import activation
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.pipeline import StagedModel
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


class OPTDecoderLayer(nn.Module):
    """x + attn(ln(x)) / ln(x + attn(x)) per ``do_layer_norm_before``, then the same for the MLP."""

    def __init__(self, config: OPTConfig, mesh, sp_mode: str, device=None):
        super().__init__()
        h, tpl = config.hidden_size, layout_of(mesh)
        self.mesh, self.pre_norm, self.p = mesh, config.do_layer_norm_before, config.dropout
        self.act = activation(config.activation_function)
        affine, bias = config.layer_norm_elementwise_affine, config.enable_bias
        self.self_attn = SelfAttention(h, config.num_attention_heads, mesh=mesh, causal=True, bias=bias,
                                       attn_dropout=config.attention_dropout, sp_mode=sp_mode, qkv="separate",
                                       device=device)
        self.self_attn_layer_norm = tpl.norm(h, elementwise_affine=affine, device=device)
        self.fc1 = tpl.linear(h, config.ffn_dim, bias, style="column", device=device)
        self.fc2 = tpl.linear(config.ffn_dim, h, bias, style="row", device=device)
        self.final_layer_norm = tpl.norm(h, elementwise_affine=affine, device=device)

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
        return layout_of(self.mesh).dropout(x, self.p, self.training)


class OPT(StagedModel):
    """OPT causal LM on ``mesh`` (arguments and stage inputs / outputs as :class:`GPT2`)."""

    causal = True

    def __init__(self, config: OPTConfig, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, device=None, seed: int | None = None):
        super().__init__()
        with self.building(device, seed) as device:  # meta: shapes only, then this rank's shards
            check_heads("OPT", config.hidden_size, config.num_attention_heads, mesh, sp_mode)
            self.config, self.mesh, self.checkpointing = config, mesh, checkpointing
            tpl = layout_of(mesh)
            self.layout = tpl.activation
            tied = {"lm_head.weight": "model.decoder.embed_tokens.weight"}
            self.tied_names = tied if config.tie_word_embeddings else {}
            blocks, self.is_first, self.is_last = common.stage_blocks("OPT", config.num_hidden_layers, stage,
                                                                      stage_layers)
            h, e = config.hidden_size, config.embed_dim
            self.model = nn.Module()
            self.model.decoder = dec = nn.Module()
            if self.is_first:
                dec.embed_tokens = tpl.vocab_embedding(config.vocab_size, e, config.pad_token_id, device=device)
                dec.embed_positions = tpl.embedding(config.max_position_embeddings + POSITION_OFFSET, h, device=device)
                if e != h:
                    dec.project_in = tpl.dense(e, h, bias=False, device=device)
            dec.layers = nn.ModuleDict({str(i): OPTDecoderLayer(config, mesh, sp_mode, device) for i in blocks})
            if self.is_last:
                if config.do_layer_norm_before and not config._remove_final_layer_norm:
                    dec.final_layer_norm = tpl.norm(h, elementwise_affine=config.layer_norm_elementwise_affine,
                                                    device=device)
                if e != h:
                    dec.project_out = tpl.dense(h, e, bias=False, device=device)
                tie = dec.embed_tokens if self.is_first and config.tie_word_embeddings else None
                self.lm_head = tpl.lm_head(e, config.vocab_size, bias=False, tie_to=tie, device=device)
                self.target_layout = tpl.after(self.lm_head)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H_l] -> hidden, or logits [b, s, V_local] (last)."""
        dec = self.model.decoder
        if self.is_first:
            common.check_seq_len("OPT", x.shape[1] * self.mesh.sp_size, self.config.max_position_embeddings,
                                 "max_position_embeddings")
            positions = local_positions(x.shape[1], self.mesh, zigzag=True, device=x.device) + POSITION_OFFSET
            emb = dec.embed_tokens(x)
            if hasattr(dec, "project_in"):
                emb = self.tpl.run_dense(dec.project_in, emb)
            x = emb + dec.embed_positions(positions[None])
            x = self.tpl.dropout(x, self.config.dropout, self.training)
        for block in dec.layers.values():
            x = self.run_block(block, x, key_padding_mask)
        if self.is_last:
            if hasattr(dec, "final_layer_norm"):
                x = dec.final_layer_norm(x)
            if hasattr(dec, "project_out"):
                x = self.tpl.run_dense(dec.project_out, x)
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


OPT_SPEC = FamilySpec("opt", OPT, OPTConfig, model_type="opt", architecture="OPTForCausalLM", base_prefix="model.",
                      head_prefixes=("lm_head.",), hf_to_shardzoo=hf_to_shardzoo, shardzoo_to_hf=shardzoo_to_hf,
                      tiny_config=tiny_config)
