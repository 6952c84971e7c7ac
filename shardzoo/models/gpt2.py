"""GPT-2 (causal LM) as a plain torch model with its plan; models/planned.py builds and splits it
(the constructor's layout arguments and the usage are in docs/models.md):

    model = GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=4), ...)
    ids = model.shard_input(ids_full)                 # [B, S] -> [b, s]
    logits = model(ids)                               # [b, s, V_local]
    loss = model.loss(logits, model.shard_target(targets_full))
    full = model.gather_output(logits)                # [B, S, V]

Parameter names follow ``GPT2LMHeadModel`` except inside blocks: ``attn.qkv`` (rows grouped per
head: head, q|k|v, head_dim, so a column split keeps heads whole), ``attn.out_proj``,
``mlp.fc1``, ``mlp.fc2``, all in nn.Linear's [out, in] layout (``hf_to_shardzoo`` converts
from Conv1D's [in, out]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.masks import sdpa_mask
from shardzoo.models.plain import MLP
from shardzoo.models.planned import PlannedModel
from shardzoo.models.spec import FamilySpec


@dataclass
class GPT2Config(HFConfig):
    """Fields of Hugging Face's GPT-2 ``config.json`` that the model uses."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    # HF options shardzoo implements only with these values (config.py)
    SUPPORTED = {"activation_function": ACTIVATION_NAMES, "scale_attn_weights": (True,),
                 "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,),
                 "add_cross_attention": (False,)}


class GPT2Attention(nn.Module):
    """Causal self-attention, q, k and v from one projection. [b, s, H] -> [b, s, H]."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        h = config.n_embd
        self.n_head, self.head_dim, self.attention_dropout = config.n_head, h // config.n_head, config.attn_pdrop
        self.qkv = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b s (h three d) -> three b h s d", three=3, d=self.head_dim)
        mask = sdpa_mask(key_padding_mask, causal=True)  # None: no padding
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.attention_dropout if self.training else 0.0)  # [b, h, s, d]
        return self.out_proj(rearrange(y, "b h s d -> b s (h d)"))


class GPT2Block(nn.Module):
    """Pre-LN block: x + drop(attn(ln_1(x))), then + drop(mlp(ln_2(x))). [b, s, H] -> same."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        h, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(h, eps=eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(h, config.n_inner or 4 * h, config.activation_function)
        self.drop = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), key_padding_mask))
        return x + self.drop(self.mlp(self.ln_2(x)))


GPT2_PLAN = {
    "transformer.wte": "vocab_embedding", "transformer.wpe": "position_embedding", "transformer.drop": "dropout",
    "ln_1": "norm", "ln_2": "norm", "transformer.ln_f": "norm", "drop": "dropout",
    "attn.qkv": "head_fused_column", "attn.out_proj": "row", "mlp.fc1": "column", "mlp.fc2": "row",
    "lm_head": "lm_head",
}


class GPT2(PlannedModel):
    """GPT-2 LM head model (one pipeline stage of it with ``stage=``); arguments: models/planned.py.

    Forward (b = batch rows, s = tokens of this stage's input):
        first stage: ids [b, s] -> ...; other stages: hidden [b, s, H] -> ...;
        last stage: ... -> logits [b, s, V]; others: hidden [b, s, H].
    """

    family = "GPT2"
    causal = True
    plan = GPT2_PLAN
    layers_field, positions_field = "n_layer", "n_positions"

    @staticmethod
    def attention_shape(config: GPT2Config) -> tuple[int, int]:
        return config.n_embd, config.n_head

    def build(self, config: GPT2Config, blocks: range) -> None:
        h = config.n_embd
        tie = config.tie_word_embeddings
        self.tied_names = {"lm_head.weight": "transformer.wte.weight"} if tie else {}
        self.transformer = nn.Module()
        if self.is_first:
            self.transformer.wte = nn.Embedding(config.vocab_size, h)
            self.transformer.wpe = nn.Embedding(config.n_positions, h)
            self.transformer.drop = nn.Dropout(config.embd_pdrop)
        self.transformer.h = nn.ModuleDict({str(i): GPT2Block(config) for i in blocks})
        if self.is_last:
            self.transformer.ln_f = nn.LayerNorm(h, eps=config.layer_norm_epsilon)
            self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
            if tie and self.is_first:
                self.lm_head.weight = self.transformer.wte.weight

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H] -> hidden, or logits [b, s, V] (last)."""
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)  # [s]
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(positions[None]))
        for block in self.transformer.h.values():
            x = block(x, key_padding_mask)
        if self.is_last:
            x = self.lm_head(self.transformer.ln_f(x))
        return x


# -- Hugging Face names ------------------------------------------------------------------------
_CONV1D = {"attn.c_proj": "attn.out_proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def hf_to_shardzoo(name: str, tensor: torch.Tensor, config: GPT2Config) -> list[tuple[str, torch.Tensor]]:
    """One ``GPT2LMHeadModel`` state-dict entry -> shardzoo (name, tensor) pairs (full size).

    Conv1D weights [in, out] become nn.Linear's [out, in]; ``c_attn`` ([q; k; v] columns)
    becomes the per-head fused ``attn.qkv``; the causal-mask buffers are dropped."""
    if name.endswith((".attn.bias", ".attn.masked_bias")):
        return []
    if ".attn.c_attn." in name:
        t = tensor.t() if name.endswith("weight") else tensor
        fused = rearrange(t, "(three h d) ... -> (h three d) ...", three=3, h=config.n_head)  # per head
        return [(name.replace("attn.c_attn", "attn.qkv"), fused.contiguous())]
    for hf, ours in _CONV1D.items():
        if f".{hf}." in name:
            t = tensor.t() if name.endswith("weight") else tensor
            return [(name.replace(hf, ours), t.contiguous())]
    return [(name, tensor)]


def hf_read_plan(name: str, config: GPT2Config) -> tuple[bool, object]:
    """How shardzoo tensor ``name`` is cut from its checkpoint tensor (``shardzoo_to_hf``'s name):
    (transposed, row map). Conv1D weights are stored [in, out], so rows of ours are columns
    there; ``attn.qkv`` row r (head h, part q/k/v, index j) is row ``part * H + h * d + j`` of
    ``c_attn``'s [q; k; v] (after the transpose for the weight)."""
    transposed = name.endswith("weight") and any(f".{ours}." in name for ours in (*_CONV1D.values(), "attn.qkv"))
    if ".attn.qkv." not in name:
        return transposed, None
    hidden, d = config.n_embd, config.n_embd // config.n_head

    def row(r: int) -> int:
        head, rest = divmod(r, 3 * d)
        part, j = divmod(rest, d)
        return part * hidden + head * d + j

    return transposed, row


def shardzoo_to_hf(name: str, tensor: torch.Tensor, config: GPT2Config) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_shardzoo` for one shardzoo entry (full size)."""
    if ".attn.qkv." in name:
        t = rearrange(tensor, "(h three d) ... -> (three h d) ...", three=3, h=config.n_head)  # [q; k; v]
        return [(name.replace("attn.qkv", "attn.c_attn"), (t.t() if name.endswith("weight") else t).contiguous())]
    for hf, ours in _CONV1D.items():
        if f".{ours}." in name:
            return [(name.replace(ours, hf), (tensor.t() if name.endswith("weight") else tensor).contiguous())]
    return [(name, tensor)]


def tiny_config(layers: int = 2, vocab: int = 101, ffn: int = 64, dropout: float = 0.0, hidden: int = 32,
                heads: int = 4) -> dict:
    """Constructor arguments of a tiny GPT-2 (16 positions), for tests."""
    return dict(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=ffn, vocab_size=vocab, n_positions=16,
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


# shardzoo plan's presets: published checkpoints' config.json values (name: fields, source)
GPT2_PRESETS = {
    "gpt2": (dict(n_layer=12, n_embd=768, n_head=12), "openai-community/gpt2 config.json"),
    "gpt2-medium": (dict(n_layer=24, n_embd=1024, n_head=16), "openai-community/gpt2-medium config.json"),
    "gpt2-xl": (dict(n_layer=48, n_embd=1600, n_head=25), "openai-community/gpt2-xl config.json"),
    "gpt3-175b": (dict(n_layer=96, n_embd=12288, n_head=96, n_positions=2048),
                  "Brown et al. 2020, Table 2.1 (GPT-3 175B: 96 layers, d_model 12288, 96 heads, context 2048; "
                  "GPT-2 vocabulary)"),
}


GPT2_SPEC = FamilySpec("gpt2", GPT2, GPT2Config, model_type="gpt2", architecture="GPT2LMHeadModel",
                       base_prefix="transformer.", head_prefixes=("lm_head.",), hf_to_shardzoo=hf_to_shardzoo,
                       shardzoo_to_hf=shardzoo_to_hf, tiny_config=tiny_config, hf_read_plan=hf_read_plan,
                       presets=GPT2_PRESETS)
