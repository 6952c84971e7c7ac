"""BERT encoder with the masked-LM head and the pooler, on any layout, whole or as one stage.

Bidirectional attention with key padding masks; sequences are split over sp in contiguous
chunks. Parameter names follow ``BertForPreTraining`` outside the encoder blocks; inside a
block (``bert.encoder.layer.{i}``) the names are shardzoo's (``hf_to_shardzoo`` maps them):

=================================== ==========================
Hugging Face                        shardzoo
=================================== ==========================
attention.self.query / key / value  attention.q_proj / k_proj / v_proj
attention.output.dense              attention.out_proj
attention.output.LayerNorm          attention_norm
intermediate.dense                  mlp.fc1
output.dense                        mlp.fc2
output.LayerNorm                    output_norm
=================================== ==========================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from shardzoo.checkpoint.hf_files import HFWeights
from shardzoo.layers.attention import SelfAttention, check_heads
from shardzoo.layers.attention_core import local_positions
from shardzoo.layers.mlp import MLP, activation
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.pipeline import StagedModel
from shardzoo.models.spec import FamilySpec, spec_of


@dataclass
class BERTConfig(HFConfig):
    """Fields of Hugging Face's BERT ``config.json`` that the model uses."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0  # null in config.json: no padding row (nn.Embedding padding_idx=None)
    tie_word_embeddings: bool = True

    SUPPORTED = {"hidden_act": ACTIVATION_NAMES, "position_embedding_type": ("absolute",), "is_decoder": (False,),
                 "add_cross_attention": (False,)}


class BertLayer(nn.Module):
    """Post-LN block: x = norm(x + attn(x)); x = norm(x + mlp(x)). [b, s, H_l] -> same."""

    def __init__(self, config: BERTConfig, mesh, sp_mode: str, device=None):
        super().__init__()
        h, eps, tpl = config.hidden_size, config.layer_norm_eps, layout_of(mesh)
        self.mesh, self.p = mesh, config.hidden_dropout_prob
        self.attention = SelfAttention(h, config.num_attention_heads, mesh=mesh, causal=False,
                                       attn_dropout=config.attention_probs_dropout_prob, sp_mode=sp_mode,
                                       qkv="separate", device=device)
        self.attention_norm = tpl.norm(h, eps, device=device)
        self.mlp = MLP(h, config.intermediate_size, mesh=mesh, act=config.hidden_act, device=device)
        self.output_norm = tpl.norm(h, eps, device=device)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention_norm(x + self._drop(self.attention(x, key_padding_mask)))
        return self.output_norm(x + self._drop(self.mlp(x)))

    def _drop(self, x):
        return layout_of(self.mesh).dropout(x, self.p, self.training)


class BERT(StagedModel):
    """BERT with MLM head (forward) and pooler (:meth:`pool`) on ``mesh``.

    Args as :class:`GPT2`, plus ``mlm_head``: build the masked-LM head (False: the bare encoder
    of ``BertModel``, e.g. sentence-embedding checkpoints), and ``pooler``: build the pooler
    (False: as ``BertForMaskedLM``, which has none; :meth:`from_pretrained` follows the
    checkpoint, so an export holds exactly what was loaded). Forward: ids [b, s] (first stage;
    ``token_type_ids`` [b, s] optional, zeros by default) or hidden [b, s, H_l] -> hidden, or on
    the last stage MLM logits [b, s, V_local] (final hidden states without the MLM head).
    ``key_padding_mask`` bool [b, s] (``shard_mask``) on every stage."""

    causal = False
    head_name = "cls.predictions.decoder"

    def __init__(self, config: BERTConfig, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, mlm_head: bool = True, pooler: bool = True, device=None,
                 seed: int | None = None):
        super().__init__()
        with self.building(device, seed) as device:  # meta: shapes only, then this rank's shards
            check_heads("BERT", config.hidden_size, config.num_attention_heads, mesh, sp_mode)
            self.config, self.mesh, self.checkpointing = config, mesh, checkpointing
            tpl = layout_of(mesh)
            self.layout = tpl.activation
            self.tied_names = ({"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}
                               if config.tie_word_embeddings and mlm_head else {})
            self.head_name = "cls.predictions.decoder" if mlm_head else None
            blocks, self.is_first, self.is_last = common.stage_blocks("BERT", config.num_hidden_layers, stage,
                                                                      stage_layers)
            h, eps = config.hidden_size, config.layer_norm_eps
            self.bert = nn.Module()
            if self.is_first:
                self.bert.embeddings = emb = nn.Module()
                emb.word_embeddings = tpl.vocab_embedding(config.vocab_size, h, config.pad_token_id, device=device)
                emb.position_embeddings = tpl.embedding(config.max_position_embeddings, h, device=device)
                emb.token_type_embeddings = tpl.embedding(config.type_vocab_size, h, device=device)
                emb.LayerNorm = tpl.norm(h, eps, device=device)
            self.bert.encoder = nn.Module()
            self.bert.encoder.layer = nn.ModuleDict({str(i): BertLayer(config, mesh, sp_mode, device) for i in blocks})
            if self.is_last:
                self.target_layout = self.layout
            if self.is_last and pooler:
                self.bert.pooler = nn.Module()
                self.bert.pooler.dense = tpl.dense(h, h, device=device)
            if self.is_last and mlm_head:
                self.cls = nn.Module()
                self.cls.predictions = pred = nn.Module()
                pred.transform = nn.Module()
                pred.transform.dense = tpl.dense(h, h, device=device)
                pred.transform.LayerNorm = tpl.norm(h, eps, device=device)
                tie = self.bert.embeddings.word_embeddings if self.is_first and config.tie_word_embeddings else None
                pred.decoder = tpl.lm_head(h, config.vocab_size, bias=False, tie_to=tie, device=device)
                tpl.vocab_bias(pred, pred.decoder, config.vocab_size, device)
                pred.mesh = mesh  # the axes of the bias's ShardSpec (checkpointing and loading need them)
                self.target_layout = tpl.after(pred.decoder)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x, token_type_ids)
        for block in self.bert.encoder.layer.values():
            x = self.run_block(block, x, key_padding_mask)
        return self.mlm_logits(x) if self.is_last and self.head_name is not None else x

    def embed(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] -> LayerNorm(word + position + token type) [b, s, H_l]."""
        emb = self.bert.embeddings
        common.check_seq_len("BERT", ids.shape[1] * self.mesh.sp_size, self.config.max_position_embeddings,
                             "max_position_embeddings")
        positions = local_positions(ids.shape[1], self.mesh, zigzag=False, device=ids.device)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(ids)
        x = emb.word_embeddings(ids) + emb.position_embeddings(positions[None]) + emb.token_type_embeddings(types)
        x = emb.LayerNorm(x)
        return self.tpl.dropout(x, self.config.hidden_dropout_prob, self.training)

    def mlm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden [b, s, H_l] -> vocab-parallel MLM logits [b, s, V_local]."""
        pred = self.cls.predictions
        x = self.tpl.run_dense(pred.transform.dense, x)
        x = pred.transform.LayerNorm(activation(self.config.hidden_act)(x))
        return self.tpl.add_vocab_bias(pred.decoder(x), pred.bias, pred.decoder)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden [b, s, H_l] -> tanh(dense(hidden of token 0)) [b, H_l] on every sp rank
        (token 0 lives on sp rank 0 and is broadcast from there)."""
        if not hasattr(self.bert, "pooler"):
            raise ValueError("this BERT has no pooler (built with pooler=False, or loaded from a checkpoint without "
                             "one, e.g. BertForMaskedLM); build it with pooler=True to pool")
        return torch.tanh(self.tpl.run_dense(self.bert.pooler.dense, self.tpl.first_token(x)))

    def gather_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """[b, H_l] -> [B, H] on every rank."""
        return self.tpl.gather_hidden(pooled)


    @classmethod
    def pretrained_kwargs(cls, hf_dir: str, kwargs: dict) -> dict:
        """``mlm_head`` and ``pooler`` default to whether the checkpoint holds them (``BertModel``
        files have no MLM head, ``BertForMaskedLM`` files no pooler)."""
        keys = [spec_of(cls).canonical(k) for k in HFWeights(hf_dir).entries]
        held = {"mlm_head": "cls.predictions.", "pooler": "bert.pooler."}
        return {**{arg: any(k.startswith(prefix) for k in keys) for arg, prefix in held.items()}, **kwargs}


_BLOCK = [("attention.self.query", "attention.q_proj"), ("attention.self.key", "attention.k_proj"),
          ("attention.self.value", "attention.v_proj"), ("attention.output.dense", "attention.out_proj"),
          ("attention.output.LayerNorm", "attention_norm"), ("intermediate.dense", "mlp.fc1"),
          ("output.dense", "mlp.fc2"), ("output.LayerNorm", "output_norm")]
_LAYER = re.compile(r"^(bert\.encoder\.layer\.\d+)\.(.+)\.(weight|bias)$")


def hf_to_shardzoo(name: str, tensor: torch.Tensor, config: BERTConfig) -> list[tuple[str, torch.Tensor]]:
    """One ``BertForPreTraining`` / ``BertForMaskedLM`` entry -> shardzoo (name, tensor) pairs.
    The next-sentence head and the embeddings' index buffers are dropped;
    ``cls.predictions.decoder.bias`` is ``cls.predictions.bias``."""
    if name.startswith("cls.seq_relationship.") or name.endswith((".position_ids", ".token_type_ids")):
        return []  # next-sentence head; index buffers of the embeddings
    if name == "cls.predictions.decoder.bias":
        return [("cls.predictions.bias", tensor)]
    renamed = common.rename_block_param(name, _LAYER, _BLOCK, to_ours=True)
    return [(renamed or name, tensor)]


def shardzoo_to_hf(name: str, tensor: torch.Tensor, config: BERTConfig) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_shardzoo`."""
    renamed = common.rename_block_param(name, _LAYER, _BLOCK, to_ours=False)
    return [(renamed or name, tensor)]


def tiny_config(layers: int = 2, vocab: int = 101, ffn: int = 64, dropout: float = 0.0, hidden: int = 32,
                heads: int = 4) -> dict:
    """Constructor arguments of a tiny BERT (16 positions), for tests."""
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
                vocab_size=vocab, max_position_embeddings=16, hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout)


BERT_SPEC = FamilySpec("bert", BERT, BERTConfig, model_type="bert", architecture="BertForMaskedLM",
                       base_prefix="bert.", head_prefixes=("cls.",), hf_to_shardzoo=hf_to_shardzoo,
                       shardzoo_to_hf=shardzoo_to_hf, tiny_config=tiny_config, optional_prefixes=("bert.pooler.",))
