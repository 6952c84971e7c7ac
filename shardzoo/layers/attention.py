"""Multi-head self-attention: tensor-parallel heads (any tp_mode) x sequence-parallel tokens (sp).

Projections come from the mesh's layout (layers/tensor_layout.py). The heads follow the hidden
columns of the QKV projection's output, so each rank computes whole heads:

====== ============================== ====================== ===============================
mode   QKV / output projection         heads on a rank        batch rows on a rank
====== ============================== ====================== ===============================
1d     column / row ParallelLinear1D   block tp_rank of tp    all
2d     ParallelLinear2D (SUMMA)        block tp_col of q      block tp_row of q
2.5d   ParallelLinear2p5D              block tp_col of q      block (tp_dep, tp_row) of d*q
3d     ParallelLinear3D, chained       block tp_y of q        block (tp_x, tp_z) of q*q
====== ============================== ====================== ===============================

(num_heads must be divisible by tp in 1D and by q otherwise.) In 3D the QKV projection maps
the canonical layout (tp_x, tp_y | tp_z) to (tp_x, tp_z | tp_y) and the output projection maps
it back, so the module starts and ends in the canonical layout; the key padding mask is split
like the heads' batch rows (``shard_mask``).

The fused QKV weight ``qkv.weight`` [3*H, H] orders its rows per head, ``(head, q|k|v,
head_dim)`` (Megatron's layout), so that any contiguous split along the rows holds whole heads
with their q, k and v: :func:`fuse_qkv` / :func:`split_qkv` convert from / to separate q, k, v.
``qkv="separate"`` keeps three projections ``q_proj`` / ``k_proj`` / ``v_proj`` (one GEMM and
one backward tp all-reduce each instead of one in total).

Sequence: tokens are split over sp (zigzag for causal), attention runs by ring attention or
Ulysses (``sp_mode``); see layers/attention_core.py, also for dropout on the probabilities.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from shardzoo.layers.attention_core import SP_MODES, sequence_attention
from shardzoo.layers.sequence import shard_padding_mask
from shardzoo.layers.tensor_layout import layout_of


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Separate q, k, v weights [H, in] (or biases [H]) -> the per-head fused [3H, in] ([3H])."""
    return rearrange(torch.stack([q, k, v]), "three (h d) ... -> (h three d) ...", h=num_heads)


def split_qkv(fused: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: [3H, ...] per-head fused -> (q, k, v), each [H, ...]."""
    q, k, v = rearrange(fused, "(h three d) ... -> three (h d) ...", three=3, h=num_heads)
    return q, k, v


def check_heads(who: str, hidden_size: int, num_heads: int, mesh, sp_mode: str = "ring") -> None:
    """Raise a message naming value, rule and fix unless the heads split over tp (and sp)."""
    if hidden_size % num_heads != 0:
        raise ValueError(f"{who} needs hidden_size divisible by num_heads; got hidden_size={hidden_size}, "
                         f"num_heads={num_heads}. Choose num_heads that divides {hidden_size}")
    tpl = layout_of(mesh)
    _, parts = tpl.head_axis()
    rule = tpl.head_rule()
    if num_heads % parts != 0:
        raise ValueError(f"{who} needs num_heads divisible by {rule}; got num_heads={num_heads}. Use a head count "
                         f"that is a multiple of {parts} or a smaller tp")
    if sp_mode not in SP_MODES:
        raise ValueError(f"{who}: sp_mode={sp_mode!r} is not one of {SP_MODES}")
    local, sp = num_heads // parts, mesh.sp_size
    if sp_mode == "ulysses" and local % sp != 0:
        raise ValueError(f"{who}(sp_mode='ulysses') needs the heads per tp rank ({local}) divisible by sp={sp}; "
                         f"use sp_mode='ring', a smaller sp, or more heads")


class SelfAttention(nn.Module):
    """Self-attention on a ParallelMesh: ``out_proj(attend(split_heads(qkv(x))))``.

    Args:
        hidden_size, num_heads: H and the number of heads (head_dim = H / num_heads).
        mesh: ParallelMesh; tp splits the heads (table above), sp the sequence.
        causal: causal (GPT) or bidirectional (BERT, ViT) attention.
        bias: biases on the projections.
        attn_dropout: dropout on the attention probabilities (training only), inside the
            attention kernel with a mask that does not depend on the mesh: a tp x sp model
            drops exactly what its serial twin drops (layers/attention_core.py).
        sp_mode: "ring" or "ulysses" (used when sp > 1).
        qkv: "fused" (one ``qkv`` projection) or "separate" (``q_proj``, ``k_proj``, ``v_proj``).
        layout: input activation layout (None: the mode's canonical one).
        softmax_scale: default 1/sqrt(head_dim).
        device, dtype: of the parameters (initialised as serial ``nn.Linear`` layers drawn
            in the order q, k, v, out, or qkv, out when fused).

    Shapes (b = local batch rows, s = S/sp, H_l = hidden block of the mode):
        x [b, s, H_l] -> [b, s, H_l]; key_padding_mask bool [b, s] from :meth:`shard_mask`.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, mesh, causal: bool = False, bias: bool = True,
                 attn_dropout: float = 0.0, sp_mode: str = "ring", qkv: str = "fused", layout=None,
                 softmax_scale: float | None = None, device=None, dtype=None,
                 _serial: dict[str, nn.Linear] | None = None):
        super().__init__()
        check_heads("SelfAttention", hidden_size, num_heads, mesh, sp_mode)
        if qkv not in ("fused", "separate"):
            raise ValueError(f"SelfAttention qkv={qkv!r} must be 'fused' or 'separate'")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, hidden_size // num_heads
        self.mesh, self.causal, self.attn_dropout, self.sp_mode = mesh, causal, attn_dropout, sp_mode
        self.qkv_style, self.softmax_scale = qkv, softmax_scale
        tpl = layout_of(mesh)
        self.layout = layout or tpl.activation
        serial = _serial or self._draw_serial(bias, dtype)
        if qkv == "fused":
            if "qkv" not in serial:
                w = fuse_qkv(*(serial[n].weight for n in ("q", "k", "v")), num_heads)
                b = None if serial["q"].bias is None else fuse_qkv(*(serial[n].bias for n in ("q", "k", "v")), num_heads)
                serial["qkv"] = linear_from(w, b)
            self.qkv = tpl.linear(serial=serial["qkv"], style="column", layout=self.layout, device=device)
            first = self.qkv
        else:
            for n in ("q", "k", "v"):
                setattr(self, f"{n}_proj", tpl.linear(serial=serial[n], style="column", layout=self.layout,
                                                      device=device))
            first = self.q_proj
        self.mask_layout = tpl.after(first, self.layout)
        self.out_proj = tpl.linear(serial=serial["o"], style="row", layout=self.mask_layout, device=device)
        self.output_layout = tpl.after(self.out_proj, self.mask_layout)

    @property
    def tpl(self):
        """The mesh's :class:`~shardzoo.layers.tensor_layout.TensorLayout`."""
        return layout_of(self.mesh)

    def _draw_serial(self, bias: bool, dtype) -> dict[str, nn.Linear]:
        h = self.hidden_size
        names = ("qkv", "o") if self.qkv_style == "fused" else ("q", "k", "v", "o")
        outs = {"qkv": 3 * h}
        return {n: nn.Linear(h, outs.get(n, h), bias=bias, dtype=dtype) for n in names}

    @classmethod
    def from_serial(cls, *, q: nn.Linear | None = None, k: nn.Linear | None = None, v: nn.Linear | None = None,
                    o: nn.Linear, qkv: nn.Linear | None = None, num_heads: int, mesh, qkv_style: str = "fused",
                    **kwargs) -> "SelfAttention":
        """This rank's piece of a serial attention given as separate ``q``, ``k``, ``v`` and
        ``o`` linears, or as ``qkv`` (a fused [3H, H] ``nn.Linear`` in the usual [q; k; v] row
        order, as GPT-2's ``c_attn`` transposed) and ``o``. kwargs as the constructor."""
        if qkv is not None:
            wq, wk, wv = qkv.weight.detach().chunk(3, 0)
            bq, bk, bv = (None, None, None) if qkv.bias is None else qkv.bias.detach().chunk(3, 0)
            q, k, v = linear_from(wq, bq), linear_from(wk, bk), linear_from(wv, bv)
        if q is None or k is None or v is None:
            raise ValueError("SelfAttention.from_serial needs q=, k= and v= linears, or a fused qkv= linear")
        serial = {"q": q, "k": k, "v": v, "o": o}
        return cls(o.in_features, num_heads, mesh=mesh, bias=o.bias is not None, qkv=qkv_style,
                   _serial=serial, **kwargs)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, cu_seqlens=None) -> torch.Tensor:
        """x [b, s, H_l] -> [b, s, H_l]; key_padding_mask bool [b, s] (True = attend);
        ``cu_seqlens``: packed documents, int32 offsets over the full sequence, with x from
        :meth:`shard_input` given the same offsets."""
        d = self.head_dim
        if self.qkv_style == "fused":
            q, k, v = rearrange(self.qkv(x), "b s (h three d) -> three b h s d", three=3, d=d)
        else:
            q, k, v = (rearrange(p(x), "b s (h d) -> b h s d", d=d) for p in (self.q_proj, self.k_proj, self.v_proj))
        # the dropout mask is a function of the global batch row and head (attention_core.py)
        batch_offset, head_offset = self.tpl.block_offsets(self.mask_layout, q.shape[0], q.shape[1])
        out = sequence_attention(q, k, v, mesh=self.mesh, causal=self.causal, key_padding_mask=key_padding_mask,
                                 softmax_scale=self.softmax_scale, sp_mode=self.sp_mode,
                                 dropout_p=self.attn_dropout, training=self.training, head_offset=head_offset,
                                 batch_offset=batch_offset, cu_seqlens=cu_seqlens)
        return self.out_proj(rearrange(out, "b h s d -> b s (h d)"))

    # -- entering and leaving the parallel region (tests, users) -----------------------------
    def shard_input(self, x_full: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """[B, S, H] replicated -> [b, s, H_l]: sequence over sp (zigzag when causal, the
        per-document split with ``cu_seqlens``), then the mode's layout."""
        x = self.tpl.shard_sequence(x_full, 1, zigzag=self.causal, cu_seqlens=cu_seqlens)
        return self.tpl.shard_hidden(x, self.layout)

    def gather_output(self, y_local: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """[b, s, H_l] -> [B, S, H] on every rank."""
        y = self.tpl.gather_hidden(y_local, self.output_layout)
        return self.tpl.gather_sequence(y, 1, zigzag=self.causal, cu_seqlens=cu_seqlens)

    def shard_mask(self, mask_full: torch.Tensor) -> torch.Tensor:
        """Key padding mask bool [B, S] (True = attend) -> this rank's [b, s]."""
        mask = self.tpl.shard_batch(mask_full, self.mask_layout)
        return shard_padding_mask(mask, self.mesh.sp_group, zigzag=self.causal)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, causal={self.causal}, "
                f"sp_mode={self.sp_mode!r}, qkv={self.qkv_style!r}, attn_dropout={self.attn_dropout}")


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of ``weight`` [out, in] and ``bias``."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device="meta")
    lin.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone())
    return lin
