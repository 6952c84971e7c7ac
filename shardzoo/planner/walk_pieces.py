"""The cost pieces of a walked model (walk.py) on one layout: each module the forward ran, in
order, priced by the layout's cost object as parallelize builds it.

* 'column' / 'packed_column' / 'row' linears, 'norm' (LayerNorm, RMSNorm), 'vocab_embedding',
  'embedding' / 'position_embedding', 'lm_head' (with the vocabulary-parallel loss),
  'dropout', 'replicate' / 'replicate_sum': ``costs.linear``, ``costs.layer_norm``, ... ;
  RMSNorm here (one statistic: on the grids one all-reduce forward, its adjoint backward);
* grouped-query attention: with more head parts than kv heads a kv projection is built from the
  weight with each kv head repeated (parallel/linears.py), so it is priced as a column layer of
  parts x head_dim outputs, plus the all-reduce that sums the copies' gradients over the head
  axis (layers/replica_grads.py: one slot per distinct kv head);
* 'experts' / 'router' (a mixture-of-experts layer split over ep): planner/experts.py;
* the attention core before the attention's first 'row' projection (comm.attention_core, with
  this rank's kv heads), RoPE on q and k (its cos / sin tables), the MLP's activation (and the
  product of a gated MLP), a residual add after each 'row' projection: no communication; their
  saved bytes follow what torch keeps on CPU (tests/planner/test_memory.py measures a Llama),
  their elementwise passes are estimates.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch import nn

from shardzoo.planner.block_costs import (ID_BYTES, NORM_PASSES, Illegal, Piece, calls, elementwise, need,
                                        one_call_per_block, stat_bytes)
from shardzoo.parallel.heads import head_parts_fit, head_parts_that_work
from shardzoo.parallel.styles import STYLES
from shardzoo.planner.comm import attention_core
from shardzoo.planner.experts import check_experts, experts_piece, router_piece
from shardzoo.planner.model import ADD_PASSES, GELU_PASSES, RELU_PASSES, Batch, StageParts, dropout
from shardzoo.planner.walk import TRACE_BATCH, Step, inside

ROPE_PASSES = 6  # rotate_half, two products and a sum on q and k, forward + backward (an estimate)
MUL_PASSES = 3  # a gated MLP's act(gate) * up, forward + backward (an estimate)
ACTIVATIONS = ("act", "gelu", "relu", "silu", "swish", "tanh", "sigmoid", "mish")


def tp_size(costs) -> int:
    """Ranks of the tp grid of a cost object."""
    return costs.tp if costs.mode == "1d" else math.prod(costs.sizes.values())


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or a transformers Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def head_parts(costs) -> int:
    """Parts a column layer's output (the attention heads) is split into."""
    return costs.head_parts(costs.after(costs.canonical))


def head_axis(costs) -> str:
    return "tp" if costs.mode == "1d" else costs.after(costs.canonical).hidden_axis


def check_walk(shape, costs, b: Batch) -> None:
    """Raise :class:`Illegal` when parallelize would refuse ``shape``'s model on this tp grid
    with this sp, or the batch does not split (the rules parallelize and its layers check)."""
    walk, mode, tp = shape.walk, costs.mode, tp_size(costs)
    parts = head_parts(costs)
    for a in walk.attention.values():
        if not head_parts_fit(a.heads, a.kv_heads, parts):
            raise Illegal(f"{a.name}: tp={tp} in tp_mode={mode!r} splits the heads in {parts} parts, which must "
                          f"divide its {a.heads} heads and divide or be a multiple of its {a.kv_heads} kv heads; head "
                          f"parts that work: {head_parts_that_work(a.heads, a.kv_heads)}")
        if b.sp_mode == "ulysses":
            need("Ulysses", "the heads per tp rank", a.heads // parts, b.sp, f"sp={b.sp}")
    for name, module in walk.experts:
        check_experts(name, module, b.ep, mode)
    if mode != "1d" and walk.held:
        name = next(n for held in walk.held.values() for n, _ in held)
        raise Illegal(f"{name} holds weights the plan does not cover, and the {mode} layout splits the activations "
                      f"it reads (parallelize refuses it); plan it")
    if b.chunks > 1:
        if walk.beside_experts:
            raise Illegal(f"{walk.beside_experts[0]} sits directly in a MoE block, which reads its tokens "
                          f"flattened; under Megatron sequence parallelism (1d, tp={tp}) parallelize refuses it; "
                          f"price with sequence_parallel=False, or tp=1")
        misfits = [n for n, _ in walk.held.get("block", [])] or walk.off_chunks
        if misfits:
            raise Illegal(f"{misfits[0]} holds weights inside a block that cannot run on a sequence chunk, which "
                          f"parallelize refuses under Megatron sequence parallelism (1d, tp={tp}); plan it "
                          f"'column' / 'row' / 'norm', or price with sequence_parallel=False")
    if tp > 1 and walk.dropouts:
        raise Illegal(f"{walk.dropouts[0]} is a dropout with p > 0 the plan does not cover, which parallelize refuses "
                      f"under tp={tp}; plan it 'dropout'")
    if walk.transformers and b.sp > 1 and any(s == "position_embedding" for _, s, _ in walk.planned.values()):
        raise Illegal("a transformers model's 'position_embedding' under sp maps the positions twice (parallelize "
                      "refuses it); plan it 'embedding'")
    local_batch(shape, costs, b)


def local_batch(shape, costs, b: Batch) -> tuple[int, int]:
    """(rows, tokens) of one micro-batch on this rank, after the layout's and sp's rules; a
    model making its own sequence of N tokens (an image model's patches) pads it to a multiple of sp."""
    parts = costs.batch_parts(costs.canonical)
    need("the tp layout", "the micro-batch size", b.rows, parts, f"the batch parts of tp_mode={costs.mode} ({parts})")
    if shape.tokens is not None:
        return b.rows // parts, -(-shape.tokens // b.sp)
    chunks = 2 * b.sp if shape.causal and b.sp > 1 else b.sp
    need("sequence sharding", "the sequence length", b.seq, chunks, f"{'2*sp' if chunks != b.sp else 'sp'}={chunks}")
    if b.seq > shape.max_seq:
        raise Illegal(f"{shape.name}: sequence length {b.seq} exceeds the model's {shape.max_seq} positions")
    return b.rows // parts, b.seq // b.sp


@dataclass(frozen=True)
class Context:
    """One layout and micro-batch: the cost object, the batch, this rank's rows and tokens."""

    shape: object  # walked.ModelShape
    costs: object
    b: Batch
    batch: int
    seq: int
    chunks: int = 1  # Megatron sequence parallelism: the activation between tp layers is 1/chunks of the sequence

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    @property
    def chunk_rows(self) -> int:
        """This rank's tokens of an activation between the tp layers: its sequence chunk's (the
        sequence padded to a multiple of ``chunks``), or all of them."""
        return self.batch * -(-self.seq // self.chunks)

    @property
    def placement(self):
        return self.costs.canonical

    @property
    def mid(self):
        return self.costs.after(self.costs.canonical)

    def local(self, width: int) -> int:
        """This rank's part of an activation of ``width`` features: the hidden size split as the
        block's input, any other width (an MLP's inner width) as a column layer's output."""
        if width == self.shape.hidden:
            return width // self.costs.hidden_parts(self.placement)
        return width // self.costs.inner_parts(self.mid)


def walk_parts(shape, costs, b: Batch) -> StageParts:
    """The embeddings, one block and the head with its loss of ``shape`` on one rank of this
    layout. A head tied to the embedding's table holds it once where one stage has both
    (``last_tied``), and a copy of its own on the last of several stages (``last``; ``table``:
    the table's elements, whose gradients the two ends synchronise)."""
    check_walk(shape, costs, b)
    batch, seq = local_batch(shape, costs, b)
    ctx = Context(shape, costs, b, batch, seq)
    walk = shape.walk
    inside = dataclasses.replace(ctx, chunks=b.chunks)  # the blocks, under Megatron sequence parallelism
    enter, leave = costs.sequence_chunks(shape.hidden, ctx.rows, b.e, b.chunks) if b.chunks > 1 else (Piece(),) * 2
    first = sum(_pieces(ctx, walk.pre) + _held(ctx, "pre") + _idle(ctx, "pre"), Piece())
    # every stage computes the rotary tables; the first enters the sequence-chunked blocks and
    # the last leaves them (the stages between send and receive the chunks)
    enters = sum(rope_tables(ctx), Piece())
    block = one_call_per_block(_pieces(inside, walk.block) + _held(ctx, "block"))
    rest = _held(ctx, "post") + _idle(ctx, "post")
    last_tied = sum(_pieces(ctx, walk.post) + rest, Piece())
    table = tied_table(ctx)
    last = sum(_pieces(ctx, walk.post, untie=True) + rest, Piece()) if table else last_tied
    hidden = shape.hidden // costs.hidden_parts(costs.canonical)
    # what a pipeline stage sends (this tp rank's chunk under Megatron sequence parallelism),
    # and a block's input, which activation checkpointing keeps: the same
    boundary = block_input = inside.chunk_rows * hidden * b.e
    return StageParts(first, block, last, last_tied, boundary, table.params if table else 0, enters, leave,
                      block_input, enter)


def tied_embedding(walk) -> nn.Module | None:
    """The vocabulary embedding whose weight the 'lm_head' shares; None: the head has its own."""
    planned = walk.planned.values()
    head = next((m for m, s, _ in planned if s == "lm_head"), None)
    table = next((m for m, s, _ in planned if s == "vocab_embedding"), None)
    return table if head is not None and table is not None and table.weight is head.weight else None


def tied_table(ctx: Context) -> Piece | None:
    """The tied vocabulary embedding (tied_embedding) priced as one table; None: no tied table."""
    table = tied_embedding(ctx.shape.walk)
    if table is None:
        return None
    return ctx.costs.vocab_embedding(table.num_embeddings, table.embedding_dim, 1, ctx.b.e, ctx.placement)


def _idle(ctx: Context, part: str) -> list[Piece]:
    """Planned modules the forward does not run: their parameters only."""
    out = []
    for step in ctx.shape.walk.idle.get(part, []):
        priced = sum(step_pieces(ctx, step), Piece())
        out.append(Piece(params=priced.params, tensors=priced.tensors))
    return out


def rope_tables(ctx: Context) -> list[Piece]:
    """The cos and sin tables [1, s, head_dim] a rotary module makes before the blocks, which
    every block's RoPE reads and the first one keeps (measured)."""
    if not ctx.shape.walk.rope or not ctx.shape.walk.attention:
        return []
    head_dim = next(iter(ctx.shape.walk.attention.values())).head_dim
    return [Piece(saved=2 * ctx.seq * head_dim * ctx.b.e)]


def _held(ctx: Context, part: str) -> list[Piece]:
    """Unplanned modules holding weights: whole on every rank (1d only; check_walk)."""
    out = []
    for _, module in ctx.shape.walk.held.get(part, []):
        params = list(module.parameters(recurse=False))
        out.append(Piece(params=sum(p.numel() for p in params), tensors=len(params)))
    return out


def _pieces(ctx: Context, steps: list[Step], untie: bool = False) -> list[Piece]:
    """The pieces of ``steps`` in order; a ReLU keeps its output, which the row layer after
    it reads, so that layer keeps no copy of its input. ``untie``: price a tied head with a
    table of its own."""
    walk, out, started, relu_parent = ctx.shape.walk, [], set(), None
    whole = dataclasses.replace(ctx, chunks=1)  # between a column layer and its row layer: the whole sequence
    on_chunks = True  # under Megatron sequence parallelism, from a block's input to its first column layer
    for step in steps:
        parent = step.name.rpartition(".")[0]
        owner = walk.attention.get(parent)
        if owner is not None and step.style == "row" and owner.name not in started:
            started.add(owner.name)
            out += attention_pieces(ctx, owner)
        tp_layer = step.style in ("column", "packed_column", "head_fused_column", "row")
        reads_saved = step.style == "row" and relu_parent == parent
        here = ctx if on_chunks or tp_layer else whole
        pieces = step_pieces(here, step, untie=untie, input_saved=not reads_saved) or [Piece()]
        out += [dataclasses.replace(pieces[0], modules=pieces[0].modules + 1), *pieces[1:]]  # one module call
        if step.style is None and step.width and _is_activation(step.module):
            relu_parent = parent if _is_relu(step.module) else None
        on_chunks = step.style == "row" or (on_chunks and not tp_layer)
    return out


def attention_pieces(ctx: Context, a) -> list[Piece]:
    """The attention core of this rank's heads (and RoPE on q and k)."""
    parts = head_parts(ctx.costs)
    heads, kv = a.heads // parts, (a.kv_heads // parts if a.kv_heads % parts == 0 else 1)
    b = ctx.b
    padded = ctx.shape.tokens is not None and ctx.seq * b.sp != ctx.shape.tokens  # padding keys masked
    core = attention_core(ctx.batch, heads, ctx.seq, a.head_dim, b.e, b.sp, b.sp_mode, mask=padded,
                          causal=ctx.shape.causal, kv_heads=kv, kernel=b.attention)
    if not ctx.shape.walk.rope:
        return [core]
    return [core, Piece(**elementwise(ROPE_PASSES, ctx.rows * (heads + kv) * a.head_dim, b.e))]


def step_pieces(ctx: Context, step: Step, *, untie: bool = False, input_saved: bool = True) -> list[Piece]:
    """The pieces of one module the forward ran (module doc): its style's pricer
    (:data:`PRICERS`), or for a module the plan leaves alone, an activation's."""
    if step.style is not None:
        return PRICERS[step.style](ctx, step, untie=untie, input_saved=input_saved)
    if step.width and _is_activation(step.module):
        return activation(ctx, step)
    return []


def _column(ctx: Context, step: Step, **_) -> list[Piece]:
    return [column(ctx, step)]


def _row(ctx: Context, step: Step, *, input_saved: bool = True, **_) -> list[Piece]:
    n_in, n_out = _features(step.module)
    residual = Piece(**elementwise(ADD_PASSES, ctx.chunk_rows * ctx.local(n_out), ctx.b.e))
    owner = ctx.shape.walk.attention.get(step.name.rpartition(".")[0])
    saved = input_saved and not (owner is not None and reads_in_place(ctx, owner))
    return [ctx.costs.linear(n_in, n_out, ctx.rows, ctx.b.e, ctx.mid, style="row", bias=step.module.bias is not None,
                             input_saved=saved, **_chunked(ctx)), residual]


def _chunked(ctx: Context) -> dict:
    """The cost methods' ``chunks`` keyword under Megatron sequence parallelism (1d only)."""
    return {"chunks": ctx.chunks} if ctx.chunks > 1 else {}


def _dense(ctx: Context, step: Step, **_) -> list[Piece]:
    n_in, n_out = _features(step.module)
    rows = ctx.batch if step.dims == 2 else ctx.rows
    return [ctx.costs.dense(n_in, n_out, rows, ctx.b.e, ctx.placement, bias=step.module.bias is not None)]


def _classifier(ctx: Context, step: Step, **_) -> list[Piece]:
    """On one vector per row; F.cross_entropy keeps the logits and targets."""
    n_in, n_out = _features(step.module)
    e = ctx.b.e
    return [ctx.costs.classifier(n_out, n_in, ctx.batch, e, ctx.placement),
            Piece([], 0, ctx.batch * (n_out * e + ID_BYTES) + e)]


def _first_token(ctx: Context, step: Step, **_) -> list[Piece]:
    """Token 0 lives on sp rank 0: broadcast forward, its gradient reduced."""
    n = ctx.batch * (step.width // ctx.costs.hidden_parts(ctx.placement)) * ctx.b.e
    sp = ctx.b.sp
    return [Piece(calls("fwd", ("sp",), "broadcast", n, sp) + calls("bwd", ("sp",), "reduce", n, sp))]


def _vocab_bias(ctx: Context, step: Step, **_) -> list[Piece]:
    return [ctx.costs.vocab_bias(step.module.bias.shape[0], ctx.rows, ctx.b.e, ctx.placement)]


def _patch_embedding(ctx: Context, step: Step, **_) -> list[Piece]:
    return patch_embedding(ctx, step)


def _norm(ctx: Context, step: Step, **_) -> list[Piece]:
    return [norm(ctx, step.module)]


def _vocab_embedding(ctx: Context, step: Step, **_) -> list[Piece]:
    m = step.module
    return [ctx.costs.vocab_embedding(m.num_embeddings, m.embedding_dim, ctx.rows, ctx.b.e, ctx.placement)]


def _embedding(ctx: Context, step: Step, **_) -> list[Piece]:
    ids = ctx.seq * (ctx.batch if step.lead == TRACE_BATCH else 1)
    m = step.module
    return [ctx.costs.hidden_embedding(m.num_embeddings, m.embedding_dim, ids, ctx.b.e, ctx.placement)]


def _lm_head(ctx: Context, step: Step, *, untie: bool = False, **_) -> list[Piece]:
    tied = tied_embedding(ctx.shape.walk) is not None
    module, e = step.module, ctx.b.e
    vocab = module.out_features
    # a transformers model's loss runs on the logits upcast to fp32 (parallel/hf_model.py, as
    # transformers' own causal-LM loss does); the calls carry fp32 statistics either way
    loss_e = stat_bytes(e) if ctx.shape.walk.transformers else e
    return [ctx.costs.lm_head(vocab, module.in_features, ctx.rows, e, ctx.placement, tied=tied and not untie),
            ctx.costs.loss(vocab, ctx.rows, loss_e, ctx.placement)]


def _dropout(ctx: Context, step: Step, **_) -> list[Piece]:
    return [dropout(step.module.p, ctx.chunk_rows * ctx.local(step.width), ctx.b)] if step.width else []


def _replicate(ctx: Context, step: Step, **_) -> list[Piece]:
    return [replicated(ctx, step.module, False)]


def _replicate_sum(ctx: Context, step: Step, **_) -> list[Piece]:
    return [replicated(ctx, step.module, True)]


# one pricer per plan style (parallel/styles: the same names; tests/planner/test_walk.py checks
# that the two agree): (ctx, step, untie=, input_saved=) -> the pieces of one module
PRICERS = {
    "column": _column, "packed_column": _column, "head_fused_column": _column, "row": _row, "dense": _dense,
    "classifier": _classifier, "first_token": _first_token, "vocab_bias": _vocab_bias,
    "patch_embedding": _patch_embedding, "norm": _norm, "vocab_embedding": _vocab_embedding,
    "column_norm": _norm,  # priced as a norm over the whole width (its split over tp not yet)
    "embedding": _embedding, "position_embedding": _embedding, "lm_head": _lm_head, "dropout": _dropout,
    "replicate": _replicate, "replicate_sum": _replicate_sum,
    "experts": lambda ctx, step, **_: experts_piece(ctx, step),  # split over ep (planner/experts.py)
    "router": lambda ctx, step, **_: router_piece(ctx, step),
}


def patch_embedding(ctx: Context, step: Step) -> list[Piece]:
    """A module making the token sequence from pixels [b, C, img, img] (its Conv2d projection,
    cls token and position table) and the dropout inside it, over all N tokens; the pixels a
    rank's projection keeps are a view of the micro-batch it was given."""
    conv = next(m for m in step.module.modules() if isinstance(m, nn.Conv2d))
    drop = next((m.p for m in step.module.modules() if isinstance(m, nn.Dropout)), 0.0)
    hl = conv.out_channels // ctx.costs.hidden_parts(ctx.placement)
    emb = ctx.costs.patch_embedding(step.width, conv.kernel_size[0], conv.in_channels, conv.out_channels, ctx.b.rows,
                                    ctx.b.e, ctx.placement)
    return [emb, dropout(drop, ctx.batch * ctx.shape.tokens * hl, ctx.b)]


def reads_in_place(ctx: Context, a) -> bool:
    """Whether an attention's output projection reads the attention output in place, saving no
    bytes of its own: torch's fused CPU kernel (sp = 1, no dropout on the probabilities)
    returns its output in q's memory order, which after separate q / k / v projections is
    already [b, s, heads, d], so the head merge is a view (measured). Ring, Ulysses, the dropout kernel and a packed q|k|v give a fresh tensor the
    merge copies."""
    fused = any(s == "head_fused_column" for n, (_, s, _) in ctx.shape.walk.planned.items()
                if n.rpartition(".")[0] == a.name)
    return ctx.b.sp == 1 and not a.packed and not fused and not (ctx.b.training and attention_dropout(a.module) > 0)


def attention_dropout(module: nn.Module) -> float:
    """p of the dropout on an attention module's probabilities: its ``attention_dropout``
    (transformers' convention) or its ``attn_dropout`` module; 0 when it has none."""
    p = vars(module).get("attention_dropout")
    if isinstance(p, float):
        return p
    drop = getattr(module, "attn_dropout", None)
    return float(getattr(drop, "p", 0.0) or 0.0)


def column(ctx: Context, step: Step) -> Piece:
    """A column layer; a packed one checked part by part; a kv projection with more head parts
    than kv heads built with its heads repeated, plus the gradient sum of the copies."""
    c, e, rows, module = ctx.costs, ctx.b.e, ctx.rows, step.module
    n_in, n_out = _features(module)
    bias = module.bias is not None
    owner = ctx.shape.walk.attention.get(step.name.rpartition(".")[0])
    if step.style == "packed_column":
        k = owner.packed.get(step.name, 2) if owner is not None else 2
        blocks = c.p if c.mode == "1d" else c.q * c.q if c.mode == "3d" else c.q  # layout.column_blocks()
        need("a packed projection", f"each of its {k} parts ({n_out // k} features)", n_out // k, blocks,
             f"the {blocks} column blocks of tp_mode={c.mode}")
    parts = head_parts(c)
    repeated = owner is not None and step.name in owner.kv_projections and owner.kv_heads % parts != 0
    if repeated:
        n_out = parts * owner.head_dim
    piece = c.linear(n_in, n_out, rows, e, ctx.placement, style="column", bias=bias, input_saved=not step.shares_input,
                     **_chunked(ctx))
    if repeated:
        weight = c.linear(n_in, n_out, 1, e, ctx.placement, style="column", bias=False).params
        for local in (weight, piece.params - weight) if bias else (weight,):
            piece = piece + Piece(calls("bwd", (head_axis(c),), "all_reduce", owner.kv_heads * local * c.ep, parts))
    return piece


def norm(ctx: Context, module: nn.Module) -> Piece:
    """LayerNorm by the cost object; RMSNorm: 1d replicated (input and rstd saved); grids: the
    mean of squares all-reduced over the hidden axis forward (its adjoint backward), the weight's
    gradient summed over the batch axes."""
    c, e, rows, placement = ctx.costs, ctx.b.e, ctx.rows, ctx.placement
    weight = getattr(module, "weight", None)
    h = weight.shape[0] if weight is not None else module.normalized_shape[-1]
    affine = weight is not None
    if "rms" not in type(module).__name__.lower():
        return c.layer_norm(h, rows, e, placement, affine=affine, bias=getattr(module, "bias", None) is not None,
                            **_chunked(ctx))
    es = stat_bytes(e)
    # saved (measured on CPU): the input (the grids keep it in at least fp32), the row rstd,
    # and the normalized rows the weight multiplies
    if c.mode == "1d":
        rows = ctx.chunk_rows
        return Piece(c.chunk_param_grads(h, int(affine), ctx.chunks), h if affine else 0,
                     rows * h * e + rows * es + (rows * h * e if affine else 0),
                     tensors=int(affine), **elementwise(NORM_PASSES, rows * h, e))
    q = c.hidden_parts(placement)
    need(f"RMSNorm ({c.mode})", "normalized_shape", h, q, f"q={q}")
    hid = (placement.hidden_axis,)
    out = calls("fwd", hid, "all_reduce", rows * es, q) + calls("bwd", hid, "all_reduce", rows * es, q)
    if affine:
        out += calls("bwd", placement.batch_axes, "all_reduce", h // q * c.ep, c.batch_parts(placement))
    saved = rows * (h // q) * es + rows * es + (rows * (h // q) * e if affine else 0)
    return Piece(out, h // q if affine else 0, saved, tensors=int(affine),
                 **elementwise(NORM_PASSES, rows * (h // q), e))


def replicated(ctx: Context, module: nn.Module, summed: bool) -> Piece:
    """A module kept whole on every rank; 'replicate_sum' all-reduces each gradient over tp."""
    params = list(module.parameters())
    tp = tp_size(ctx.costs)
    axes = ("tp",) if ctx.costs.mode == "1d" else tuple(a for a, n in ctx.costs.sizes.items() if n > 1)
    out = [cl for p in params for cl in calls("bwd", axes, "all_reduce", p.numel() * ctx.costs.ep, tp)] if summed else []
    return Piece(out, sum(p.numel() for p in params), tensors=len(params))


def _is_activation(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return next(module.parameters(), None) is None and any(a in name for a in ACTIVATIONS)


def _is_relu(module: nn.Module) -> bool:
    return "relu" in type(module).__name__.lower()


def activation(ctx: Context, step: Step) -> list[Piece]:
    """An MLP's activation keeps its input (a ReLU its output); in a gated MLP (two column
    layers feeding one row layer) the product with the other branch keeps both its inputs."""
    e, n = ctx.b.e, ctx.rows * ctx.local(step.width)
    out = [Piece([], 0, n * e, **elementwise(RELU_PASSES if _is_relu(step.module) else GELU_PASSES, n, e))]
    parent = step.name.rpartition(".")[0]
    styles = [s for name, (_, s, _) in ctx.shape.walk.planned.items() if name.rpartition(".")[0] == parent]
    if sum(s == "column" for s in styles) >= 2 and "row" in styles:
        out.append(Piece([], 0, 2 * n * e, **elementwise(MUL_PASSES, n, e)))
    return out

