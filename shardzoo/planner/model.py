"""A model family's blocks, in the order one pipeline stage runs them, as cost pieces.

``stage_cost`` lists what one rank of a stage runs per micro-batch: the embeddings (first stage),
one transformer block (repeated ``blocks`` times) and the head with its loss (last stage), each
block kind priced by the layout's cost object (``TensorLayout.costs``, layers/block_costs.py),
attention over sp by comm.py.
The families mirror shardzoo/models (GPT-2, OPT: pre-LN causal LMs; BERT: post-LN encoder with
the masked-LM head; ViT: pre-LN encoder with a classifier): the same layers, in the same order,
with the same sharing of saved tensors.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from functools import cached_property

from shardzoo.layers.block_costs import ID_BYTES, Illegal, Piece, calls, elementwise, need
from shardzoo.models.common import stage_blocks
from shardzoo.planner.comm import attention_core


NOTHING = Piece()  # what a stage without the embeddings (or the head) holds of them


def _by_size(pairs) -> tuple[tuple[int, int], ...]:
    """(tensor bytes, element passes) pairs summed per tensor size."""
    out: dict[int, int] = {}
    for size, n in pairs:
        out[size] = out.get(size, 0) + n
    return tuple(out.items())


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that its costs depend on, read from its config dataclass."""

    family: str
    config: object
    name: str = ""

    @property
    def hidden(self) -> int:
        return getattr(self.config, "n_embd", None) or self.config.hidden_size

    @property
    def layers(self) -> int:
        return getattr(self.config, "n_layer", None) or self.config.num_hidden_layers

    @property
    def heads(self) -> int:
        return getattr(self.config, "n_head", None) or self.config.num_attention_heads

    @property
    def ffn(self) -> int:
        c = self.config
        if self.family == "gpt2":
            return c.n_inner or 4 * c.n_embd
        return c.ffn_dim if self.family == "opt" else c.intermediate_size

    @property
    def vocab(self) -> int:
        return 0 if self.family == "vit" else self.config.vocab_size

    @property
    def causal(self) -> bool:
        return self.family in ("gpt2", "opt")

    @property
    def max_seq(self) -> int:
        c = self.config
        return {"gpt2": lambda: c.n_positions, "vit": lambda: c.num_tokens}.get(
            self.family, lambda: c.max_position_embeddings)()

    # a family's pieces come from the formulas of this module; a model priced by walking its
    # modules and plan (walk.WalkedShape) brings its own, and is built by parallelize (pp = 1)
    walked = False
    pipelines = True

    def check(self, costs, b: "Batch") -> None:
        """Raise :class:`Illegal` when the model cannot be split on this tp grid with this sp."""
        check_heads(self, costs, b)

    def parts(self, costs, b: "Batch") -> "StageParts":
        """The pieces every stage of a layout is made of (:func:`stage_parts`)."""
        return stage_parts(self, costs, b)


@dataclass
class StageCost:
    """One rank of one pipeline stage, per micro-batch (``first`` / ``last``: zero Pieces on
    the other stages); ``block`` is one transformer block, run ``blocks`` times."""

    first: Piece
    block: list[Piece]
    blocks: int
    last: Piece
    boundary: int  # bytes of the activation this stage sends forward (and receives as gradient)
    tied_table: int  # parameter elements of the tied table synchronised with the other end (0: none)
    is_first: bool = True
    is_last: bool = True
    block_params: list[int] = field(default_factory=list)  # elements per block, for FSDP2 units

    @cached_property
    def params(self) -> int:
        return self.first.params + self.blocks * sum(p.params for p in self.block) + self.last.params

    @cached_property
    def tensors(self) -> int:
        """Parameter tensors of the stage (ZeroRedundancyOptimizer broadcasts them one by one)."""
        return self.first.tensors + self.blocks * sum(p.tensors for p in self.block) + self.last.tensors

    @cached_property
    def block_saved(self) -> int:
        """Activation bytes one block keeps for backward."""
        return sum(p.saved for p in self.block)

    @cached_property
    def block_work(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """(matmul FLOPs, attention FLOPs, elementwise passes as (tensor bytes, element passes)
        pairs) of one block, forward (elementwise: forward + backward)."""
        return (sum(p.flops for p in self.block), sum(p.attn_flops for p in self.block),
                _by_size(w for p in self.block for w in p.elementwise))

    @cached_property
    def work(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """The same for the whole stage and one micro-batch."""
        ends = (self.first, self.last)
        flops, attn, block = self.block_work
        elementwise = [(size, self.blocks * n) for size, n in block] + [w for p in ends for w in p.elementwise]
        return (self.blocks * flops + sum(p.flops for p in ends), self.blocks * attn + sum(p.attn_flops for p in ends),
                _by_size(elementwise))

    @cached_property
    def workspace(self) -> int:
        """The largest transient of any piece of the stage."""
        return max(p.workspace for p in (self.first, self.last, *self.block))


@dataclass(frozen=True)
class Batch:
    """What one micro-batch looks like on this rank's tp x sp group."""

    rows: int  # micro-batch rows (sequences) per dp replica
    seq: int  # full sequence length
    sp: int
    sp_mode: str
    e: int  # bytes per activation element
    training: bool = True
    mask_bytes: int = 1  # per element of a dropout mask: bool on CUDA, the activation dtype on CPU


DROPOUT_PASSES, GELU_PASSES, RELU_PASSES, ADD_PASSES = 5, 4, 2, 2  # elementwise passes, fwd + bwd


def dropout(p: float, n: int, b: "Batch") -> Piece:
    """F.dropout keeps a mask of the ``n`` elements it drops from (bool on CUDA; on CPU the
    scaled noise tensor, in the activation dtype)."""
    on = b.training and p > 0
    return Piece([], 0, n * b.mask_bytes if on else 0, **elementwise(DROPOUT_PASSES, n if on else 0, b.e))


def _check_batch(shape: ModelShape, costs, b: Batch) -> tuple[int, int]:
    """(local batch rows, local tokens) with the layout's and sp's divisibility rules."""
    parts = costs.batch_parts(costs.canonical)
    need("the tp layout", "the micro-batch size", b.rows, parts, f"the batch parts of tp_mode={costs.mode} ({parts})")
    if shape.family == "vit":
        return b.rows // parts, -(-shape.config.num_tokens // b.sp)
    chunks = 2 * b.sp if shape.causal and b.sp > 1 else b.sp
    need("sequence sharding", "the sequence length", b.seq, chunks,
         f"{'2*sp' if chunks != b.sp else 'sp'}={chunks}")
    if b.seq > shape.max_seq:
        raise Illegal(f"{shape.family}: sequence length {b.seq} exceeds the model's {shape.max_seq} positions")
    return b.rows // parts, b.seq // b.sp


def check_heads(shape: ModelShape, costs, b: Batch) -> None:
    h, heads = shape.hidden, shape.heads
    parts = costs.head_parts(costs.after(costs.canonical))
    need(shape.family, "num_heads", heads, parts, f"the tp head split ({parts})")
    if b.sp_mode == "ulysses":
        need("Ulysses", "the heads per tp rank", heads // parts, b.sp, f"sp={b.sp}")
    need(shape.family, "hidden_size", h, heads, f"num_heads={heads}")


def p_attn_drop(family: str) -> str:
    """The config field of dropout on the attention probabilities."""
    return {"gpt2": "attn_pdrop", "opt": "attention_dropout"}.get(family, "attention_probs_dropout_prob")


def transformer_block(shape: ModelShape, costs, b: Batch, batch: int, seq: int) -> list[Piece]:
    """The pieces of one block: attention (fused or separate q/k/v), MLP, norms, dropouts."""
    c, fam = shape.config, shape.family
    h, f, e, lay = shape.hidden, shape.ffn, b.e, costs.canonical
    mid = costs.after(lay)
    rows = batch * seq
    hl, fl = h // costs.hidden_parts(lay), f // costs.inner_parts(mid)
    heads = shape.heads // costs.head_parts(mid)
    bias = {"gpt2": True, "opt": getattr(c, "enable_bias", True), "vit": getattr(c, "qkv_bias", True)}.get(fam, True)
    affine = getattr(c, "layer_norm_elementwise_affine", True)
    p_drop = {"gpt2": "resid_pdrop", "opt": "dropout"}.get(fam, "hidden_dropout_prob")
    drop = dropout(getattr(c, p_drop), rows * hl, b)
    norm = costs.layer_norm(h, rows, e, lay, affine=affine)
    if fam == "gpt2":
        qkv = [costs.linear(h, 3 * h, rows, e, lay, style="column", bias=True)]
    else:  # q_proj, k_proj, v_proj read the same input
        qkv = [costs.linear(h, h, rows, e, lay, style="column", bias=bias, input_saved=i == 0) for i in range(3)]
    attn = attention_core(batch, heads, seq, h // shape.heads, e, b.sp, b.sp_mode,
                          mask=fam == "vit" and seq * b.sp != c.num_tokens, causal=shape.causal)
    # torch's fused CPU attention kernel (sp = 1, no dropout on the probabilities) returns its
    # output in q's memory order; after separate q / k / v projections that is already
    # [b, s, heads, d], so out_proj reads it in place (measured). Ring, Ulysses and the dropout
    # kernel return a fresh [b, heads, s, d] that the head merge copies.
    in_place = fam != "gpt2" and b.sp == 1 and not (b.training and getattr(c, p_attn_drop(fam), 0.0) > 0)
    out_proj = costs.linear(h, h, rows, e, mid, style="row", bias=bias, input_saved=not in_place)
    act = getattr(c, "activation_function", None) or c.hidden_act
    fc1 = costs.linear(h, f, rows, e, lay, style="column", bias=bias if fam == "opt" else True)
    relu = act.startswith("relu")  # gelu keeps its input, relu its output (fc2's input)
    act_saved = Piece([], 0, rows * fl * e, **elementwise(RELU_PASSES if relu else GELU_PASSES, rows * fl, e))
    fc2 = costs.linear(f, h, rows, e, mid, style="row", bias=bias if fam == "opt" else True, input_saved=not relu)
    residual = Piece(**elementwise(ADD_PASSES, rows * hl, e))
    attention, mlp = [*qkv, attn, out_proj, drop, residual], [fc1, act_saved, fc2, drop, residual]
    if fam == "bert" or (fam == "opt" and not c.do_layer_norm_before):  # post-LN
        return attention + [norm] + mlp + [costs.layer_norm(h, rows, e, lay, affine=affine)]
    return [norm] + attention + [costs.layer_norm(h, rows, e, lay, affine=affine)] + mlp


def _embeddings(shape: ModelShape, costs, b: Batch, batch: int, seq: int) -> Piece:
    c, fam, h, e, lay = shape.config, shape.family, shape.hidden, b.e, costs.canonical
    rows, hl = batch * seq, h // costs.hidden_parts(lay)
    if fam == "vit":
        tokens = c.num_tokens
        # the pixels a rank's projection keeps are a view of the micro-batch it was given
        emb = costs.patch_embedding(c.image_size, c.patch_size, c.num_channels, h, b.rows, e, lay)
        return emb + dropout(c.hidden_dropout_prob, batch * tokens * hl, b)
    width = c.embed_dim if fam == "opt" else h
    out = costs.vocab_embedding(shape.vocab, width, rows, e, lay)
    if fam == "opt" and width != h:
        out = out + costs.dense(width, h, rows, e, lay, bias=False)
    positions = c.n_positions if fam == "gpt2" else c.max_position_embeddings + (2 if fam == "opt" else 0)
    out = out + costs.hidden_embedding(positions, h, seq, e, lay)
    if fam == "bert":
        out = out + costs.hidden_embedding(c.type_vocab_size, h, rows, e, lay) + costs.layer_norm(h, rows, e, lay)
    p = {"gpt2": "embd_pdrop", "opt": "dropout"}.get(fam, "hidden_dropout_prob")
    return out + dropout(getattr(c, p), rows * hl, b)


def _head(shape: ModelShape, costs, b: Batch, batch: int, seq: int, tied: bool) -> Piece:
    c, fam, h, e, lay = shape.config, shape.family, shape.hidden, b.e, costs.canonical
    rows = batch * seq
    if fam == "vit":
        cls = Piece(calls("fwd", ("sp",), "broadcast", batch * (h // costs.hidden_parts(lay)) * e, b.sp)
                    + calls("bwd", ("sp",), "reduce", batch * (h // costs.hidden_parts(lay)) * e, b.sp))
        out = costs.layer_norm(h, rows, e, lay) + cls + costs.classifier(c.num_labels, h, batch, e, lay)
        out = out + Piece([], 0, batch * (c.num_labels * e + ID_BYTES) + e)  # F.cross_entropy: logits, targets
        return out
    out = Piece()
    if fam == "gpt2" or (fam == "opt" and c.do_layer_norm_before and not c._remove_final_layer_norm):
        out = costs.layer_norm(h, rows, e, lay, affine=getattr(c, "layer_norm_elementwise_affine", True))
    width = h
    if fam == "opt" and c.embed_dim != h:
        width = c.embed_dim
        out = out + costs.dense(h, width, rows, e, lay, bias=False)
    if fam == "bert":  # the pooler is held but not run by the MLM loss; transform: dense, gelu, LayerNorm
        pooler = costs.dense(h, h, batch, e, lay)
        out = Piece(params=pooler.params, tensors=pooler.tensors) + costs.dense(h, h, rows, e, lay)
        out = out + Piece([], 0, rows * (h // costs.hidden_parts(lay)) * e) + costs.layer_norm(h, rows, e, lay)
    out = out + costs.lm_head(shape.vocab, width, rows, e, lay, tied=tied)
    if fam == "bert":
        out = out + costs.vocab_bias(shape.vocab, rows, e, lay)
    return out + costs.loss(shape.vocab, rows, e, lay)


LOSS_PAIR_BYTES = 16  # model.loss all-reduces [sum, count] in fp64
COUNT_BYTES = 8  # count_targets all-reduces one int64


def target_axes(shape: ModelShape, costs, dp: int, sp: int) -> list[tuple[str, int]]:
    """(axis, size) of the mesh axes the targets are split over (layers/batch_loss.py): dp, sp
    (not for ViT, whose labels every sp rank holds) and the batch axes of the head's layout."""
    lay = costs.canonical
    batch = [(a, costs.size(a)) for a in lay.batch_axes] if lay is not None else []
    return [("dp", dp)] + ([] if shape.family == "vit" else [("sp", sp)]) + batch


def loss_reduction(axes: list[tuple[str, int]], payload: int, pp: int, phase: str = "fwd") -> list:
    """The global-mean loss's all-reduce of ``payload`` bytes over the target axes: one call
    over their combined group, or one per axis on a pipeline's last stage."""
    axes = [(a, n) for a, n in axes if n > 1]
    if pp == 1:
        return calls(phase, tuple(a for a, _ in axes), "all_reduce", payload, math.prod(n for _, n in axes)) if axes else []
    return [c for a, n in axes for c in calls(phase, (a,), "all_reduce", payload, n)]


def tied(shape: ModelShape) -> bool:
    return shape.family != "vit" and bool(getattr(shape.config, "tie_word_embeddings", False))


@dataclass
class StageParts:
    """The pieces every stage of a layout is made of, for one micro-batch size."""

    first: Piece
    block: list[Piece]
    last: Piece  # the head with its own table
    last_tied: Piece  # the head sharing the embedding's table (first and last stage in one)
    boundary: int
    table: int  # parameter elements of the vocabulary table (0: no tied table)


def stage_parts(shape: ModelShape, costs, b: Batch) -> StageParts:
    """Raises :class:`Illegal` (the rule in the message) when the model cannot be built so."""
    check_heads(shape, costs, b)
    batch, seq = _check_batch(shape, costs, b)
    lay = costs.canonical
    block = transformer_block(shape, costs, b, batch, seq)
    first = _embeddings(shape, costs, b, batch, seq)
    last = _head(shape, costs, b, batch, seq, False)
    last_tied = _head(shape, costs, b, batch, seq, True) if tied(shape) else last
    boundary = batch * seq * (shape.hidden // costs.hidden_parts(lay)) * b.e
    table = 0
    if tied(shape):
        width = shape.config.embed_dim if shape.family == "opt" else shape.hidden
        table = costs.vocab_embedding(shape.vocab, width, 1, b.e, lay).params
    return StageParts(first, block, last, last_tied, boundary, table)


def assemble(shape: ModelShape, parts: StageParts, stage: int = 0, stages: int = 1) -> StageCost:
    """Stage ``stage`` of ``stages`` from its parts."""
    try:
        blocks, is_first, is_last = stage_blocks(shape.family, shape.layers, (stage, stages) if stages > 1 else None,
                                                 None)
    except ValueError as err:
        raise Illegal(str(err)) from None
    first = parts.first if is_first else NOTHING
    last = (parts.last_tied if is_first else parts.last) if is_last else NOTHING
    table = parts.table if stages > 1 and (is_first or is_last) else 0
    return StageCost(first, parts.block, len(blocks), last, parts.boundary, table, is_first, is_last,
                     [sum(p.params for p in parts.block)] * len(blocks))


def stage_cost(shape: ModelShape, costs, b: Batch, stage: int = 0, stages: int = 1) -> StageCost:
    """What one rank of pipeline stage ``stage`` of ``stages`` runs per micro-batch."""
    return assemble(shape, stage_parts(shape, costs, b), stage, stages)
