"""BERT (masked-LM head and pooler) as a plain torch model with its plan; models/planned.py builds
and splits it (the constructor's layout arguments and the usage are in docs/models.md):

    model = BERT(BERTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4), ...)
    ids, types = model.shard_input(ids_full), model.shard_input(types_full)   # [B, S] -> [b, s]
    logits = model(ids, model.shard_mask(mask_full), types)                 # [b, s, V_local]
    full = model.gather_output(logits)                                      # [B, S, V]

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
from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.plain import MLP, Attention, activation_module
from shardzoo.models.planned import PlannedModel
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
    """Post-LN block: x = norm(x + drop(attn(x))); x = norm(x + drop(mlp(x))). [b, s, H] -> same."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = Attention(config.hidden_size, config.num_attention_heads, causal=False,
                                   dropout=config.attention_probs_dropout_prob)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.output_norm = nn.LayerNorm(h, eps=eps)
        self.drop = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention_norm(x + self.drop(self.attention(x, key_padding_mask)))
        return self.output_norm(x + self.drop(self.mlp(x)))


class BertEmbeddings(nn.Module):
    """LayerNorm(word + position + token type) then dropout: ids [b, s] -> [b, s, H]."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, s]
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.dropout(self.LayerNorm(x))


class BertPooler(nn.Module):
    """tanh(dense(hidden of token 0)): [b, s, H] -> [b, H]."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertLMHead(nn.Module):
    """Masked-LM head: transform (dense, act, LayerNorm), then the decoder (tied to the word
    embeddings, no bias of its own) plus ``bias``: [b, s, H] -> logits [b, s, V]."""

    def __init__(self, config: BERTConfig):
        super().__init__()
        h = config.hidden_size
        self.transform = nn.Module()
        self.transform.dense = nn.Linear(h, h)
        self.transform.act = activation_module(config.hidden_act)
        self.transform.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(h, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transform
        return self.decoder(t.LayerNorm(t.act(t.dense(x)))) + self.bias


BERT_PLAN = {
    "word_embeddings": "vocab_embedding", "position_embeddings": "position_embedding",
    "token_type_embeddings": "embedding", "LayerNorm": "norm", "dropout": "dropout", "drop": "dropout",
    "attention.q_proj": "column", "attention.k_proj": "column", "attention.v_proj": "column",
    "attention.out_proj": "row", "attention_norm": "norm", "mlp.fc1": "column", "mlp.fc2": "row",
    "output_norm": "norm",
    "bert.pooler": "first_token", "bert.pooler.dense": "dense",  # token 0 lives on sp rank 0
    "cls.predictions": "vocab_bias", "cls.predictions.transform.dense": "dense", "cls.predictions.decoder": "lm_head",
}


class BERT(PlannedModel):
    """BERT with the MLM head (forward) and the pooler (:meth:`pool`); arguments: models/planned.py,
    plus ``mlm_head``: build the masked-LM head (False: the bare encoder of ``BertModel``, e.g.
    sentence-embedding checkpoints), and ``pooler``: build the pooler (False: as
    ``BertForMaskedLM``, which has none; :meth:`from_pretrained` follows the checkpoint, so an
    export holds exactly what was loaded).

    Forward (b = batch rows, s = tokens of this rank): first stage: ids [b, s] and
    ``token_type_ids`` [b, s] (zeros by default) -> ...; other stages: hidden [b, s, H] -> ...;
    last stage: ... -> MLM logits [b, s, V] (final hidden states without the MLM head);
    ``key_padding_mask`` bool [b, s] (True = attend) on every stage."""

    family = "BERT"
    causal = False
    plan = BERT_PLAN
    with_mlm_head, with_pooler = True, True  # the constructor's defaults (serial_model builds both)

    def __init__(self, config: BERTConfig, *, mlm_head: bool = True, pooler: bool = True, **kwargs):
        self.with_mlm_head, self.with_pooler = mlm_head, pooler  # read by build(), called by the base constructor
        super().__init__(config, **kwargs)

    def build(self, config: BERTConfig, blocks: range) -> None:
        mlm = self.with_mlm_head
        tie = config.tie_word_embeddings and mlm
        self.tied_names = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"} if tie else {}
        self.head_name = "cls.predictions.decoder" if mlm else None
        self.bert = nn.Module()
        if self.is_first:
            self.bert.embeddings = BertEmbeddings(config)
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleDict({str(i): BertLayer(config) for i in blocks})
        if self.is_last and self.with_pooler:
            self.bert.pooler = BertPooler(config)
        if self.is_last and mlm:
            self.cls = nn.Module()
            self.cls.predictions = BertLMHead(config)
            if tie and self.is_first:
                self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H] -> hidden, or MLM logits [b, s, V] (last)."""
        if self.is_first:
            x = self.embed(x, token_type_ids)
        for block in self.bert.encoder.layer.values():
            x = block(x, key_padding_mask)
        return self.mlm_logits(x) if self.is_last and self.head_name is not None else x

    def embed(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] -> LayerNorm(word + position + token type) [b, s, H] (first stage)."""
        return self.bert.embeddings(ids, token_type_ids)

    def mlm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden [b, s, H] -> MLM logits [b, s, V] (last stage)."""
        return self.cls.predictions(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden [b, s, H] -> tanh(dense(hidden of token 0)) [b, H] (last stage)."""
        if not hasattr(self.bert, "pooler"):
            raise ValueError("this BERT has no pooler (built with pooler=False, or loaded from a checkpoint without "
                             "one, e.g. BertForMaskedLM); build it with pooler=True to pool")
        return self.bert.pooler(x)

    def gather_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """This rank's pooled rows [b, H] -> [B, H] on every rank."""
        return self.gather_rows(pooled)

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


# shardzoo plan's presets: published checkpoints' config.json values (name: fields, source)
BERT_PRESETS = {
    "bert-base": (dict(), "google-bert/bert-base-uncased config.json"),
    "bert-large": (dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
                   "google-bert/bert-large-uncased config.json"),
}


BERT_SPEC = FamilySpec("bert", BERT, BERTConfig, model_type="bert", architecture="BertForMaskedLM",
                       base_prefix="bert.", head_prefixes=("cls.",), hf_to_shardzoo=hf_to_shardzoo,
                       shardzoo_to_hf=shardzoo_to_hf, tiny_config=tiny_config, optional_prefixes=("bert.pooler.",),
                       presets=BERT_PRESETS)
