"""GPT-2 (causal LM) on any layout, whole or as one pipeline stage.

    mesh = ParallelMesh(tp=4, tp_mode="2d", sp=2)
    model = GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=4), mesh=mesh)
    ids = model.shard_input(ids_full)                 # [B, S] -> [b, s]
    logits = model(ids)                               # [b, s, V_local]
    loss = model.loss(logits, model.shard_target(targets_full))
    full = model.gather_output(logits)                # [B, S, V]

Parameter names follow ``GPT2LMHeadModel`` except inside blocks: ``attn.qkv`` (per-head fused,
see layers/attention.py), ``attn.out_proj``, ``mlp.fc1``, ``mlp.fc2``, all in nn.Linear's
[out, in] layout (``hf_to_shardzoo`` converts from Conv1D's [in, out]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardzoo.layers.attention import SelfAttention, check_heads, fuse_qkv, split_qkv
from shardzoo.layers.attention_core import local_positions
from shardzoo.layers.mlp import MLP
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.models import common
from shardzoo.models.config import ACTIVATION_NAMES, HFConfig
from shardzoo.models.pipeline import StagedModel
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


class GPT2Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then + mlp(ln_2(x)). [b, s, H_l] -> same."""

    def __init__(self, config: GPT2Config, mesh, sp_mode: str, device=None):
        super().__init__()
        h, eps, tpl = config.n_embd, config.layer_norm_epsilon, layout_of(mesh)
        self.mesh, self.resid_pdrop = mesh, config.resid_pdrop
        self.ln_1 = tpl.norm(h, eps, device=device)
        self.attn = SelfAttention(h, config.n_head, mesh=mesh, causal=True, attn_dropout=config.attn_pdrop,
                                  sp_mode=sp_mode, device=device)
        self.ln_2 = tpl.norm(h, eps, device=device)
        self.mlp = MLP(h, config.n_inner or 4 * h, mesh=mesh, act=config.activation_function, device=device)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln_1(x), key_padding_mask))
        return x + self._drop(self.mlp(self.ln_2(x)))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return layout_of(self.mesh).dropout(x, self.resid_pdrop, self.training)


class GPT2(StagedModel):
    """GPT-2 LM head model on ``mesh``; ``stage=(k, n)`` / ``stage_layers`` build one pipeline stage.

    Args:
        config: GPT2Config. mesh: ParallelMesh (tp in any mode, sp, dp, pp).
        stage, stage_layers: pipeline stage (models/common.stage_blocks); None: whole model.
        sp_mode: "ring" or "ulysses" attention over sp. checkpointing: recompute each block
            in backward (activation checkpointing).
        device: of the parameters.

    Forward (stage inputs / outputs, b = local batch rows, s = S/sp tokens):
        first stage: ids [b, s] -> ...; other stages: hidden [b, s, H_l] -> ...;
        last stage: ... -> vocab-parallel logits [b, s, V_local]; others: hidden [b, s, H_l].
    """

    family = "GPT2"
    causal = True

    def __init__(self, config: GPT2Config, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, device=None, seed: int | None = None):
        super().__init__()
        with self.building(device, seed) as device:  # meta: shapes only, then this rank's shards
            check_heads("GPT2", config.n_embd, config.n_head, mesh, sp_mode)
            self.config, self.mesh, self.checkpointing = config, mesh, checkpointing
            self.tied_names = {"lm_head.weight": "transformer.wte.weight"} if config.tie_word_embeddings else {}
            tpl = layout_of(mesh)
            self.layout = tpl.activation
            blocks, self.is_first, self.is_last = common.stage_blocks("GPT2", config.n_layer, stage, stage_layers)
            h = config.n_embd
            self.transformer = nn.Module()
            if self.is_first:
                self.transformer.wte = tpl.vocab_embedding(config.vocab_size, h, device=device)
                self.transformer.wpe = tpl.embedding(config.n_positions, h, device=device)
            self.transformer.h = nn.ModuleDict({str(i): GPT2Block(config, mesh, sp_mode, device) for i in blocks})
            if self.is_last:
                self.transformer.ln_f = tpl.norm(h, config.layer_norm_epsilon, device=device)
                tie = self.transformer.wte if self.is_first and config.tie_word_embeddings else None
                self.lm_head = tpl.lm_head(h, config.vocab_size, bias=False, tie_to=tie, device=device)
                self.target_layout = tpl.after(self.lm_head)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, H_l] -> hidden, or logits [b, s, V_local] (last)."""
        if self.is_first:
            x = self.embed(x)
        for block in self.transformer.h.values():
            x = self.run_block(block, x, key_padding_mask)
        if self.is_last:
            x = self.lm_head(self.transformer.ln_f(x))
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> token + position embeddings [b, s, H_l] (dropout embd_pdrop)."""
        seq = ids.shape[1] * self.mesh.sp_size
        common.check_seq_len("GPT2", seq, self.config.n_positions, "n_positions")
        positions = local_positions(ids.shape[1], self.mesh, zigzag=True, device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(positions[None])
        return self.tpl.dropout(x, self.config.embd_pdrop, self.training)


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
        return [(name.replace("attn.c_attn", "attn.qkv"), fuse_qkv(*t.chunk(3, 0), config.n_head).contiguous())]
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
        t = torch.cat(split_qkv(tensor, config.n_head), 0)
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


GPT2_SPEC = FamilySpec("gpt2", GPT2, GPT2Config, model_type="gpt2", architecture="GPT2LMHeadModel",
                       base_prefix="transformer.", head_prefixes=("lm_head.",), hf_to_shardzoo=hf_to_shardzoo,
                       shardzoo_to_hf=shardzoo_to_hf, tiny_config=tiny_config, hf_read_plan=hf_read_plan)
