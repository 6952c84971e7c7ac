"""What each block costs in each tp_mode: the collectives one rank issues, the parameter elements
it holds and the activation bytes autograd keeps for backward.

This module is the only place that knows the per-layout formulas (docs/tp_modes.md, docs/tp1d.md,
docs/planner.md); the planner adds pieces up. Each layout states its costs through it: one object
per tp_mode (:func:`costs_of`, e.g. ``costs_of("2d", tp=4)``) offers the same methods, one
per kind of block: ``linear``,
``layer_norm``, ``vocab_embedding``, ``hidden_embedding``, ``lm_head``, ``loss``, ``dense`` (a
projection that leaves the activation in its placement), ``classifier``, ``patch_embedding``,
``vocab_bias``; each returns a :class:`Piece`.

Arguments: ``rows`` = this rank's activation rows (tokens), ``e`` = bytes per activation
element, ``placement`` = the activation placement consumed (None in 1D; ``after(placement)`` is the one
a linear produces). Parameters, their gradients and gathered tables travel in ``ep`` bytes per
element. A call on a group of one rank is left out: ``shardzoo.comm`` sends nothing there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shardzoo.layers.placements import ActivationPlacement, canonical_for, swapped_3d

ID_BYTES = 8  # int64 token ids and lookup indices
MASK_BYTES = 1  # bool masks


class Illegal(ValueError):
    """A block cannot be built in this layout (the message names the value and the rule)."""


@dataclass(frozen=True)
class Call:
    """One collective (or p2p send) of one rank, as ``shardzoo.comm.accounting`` counts it.

    phase: "fwd" / "bwd" (per micro-batch) or "step" (once per step); axes: mesh axes of the
    group; kind, payload, group_size: as ``CommRecord``; times: repeats; after_save: a forward
    call after the block's last saved tensor (activation checkpointing's recompute stops before
    it); counted: False where the code calls torch.distributed directly (comm.count misses it)."""

    phase: str
    axes: tuple[str, ...]
    kind: str
    payload: int
    group_size: int
    times: int = 1
    after_save: bool = False
    counted: bool = True
    per_block: bool = False


@dataclass
class Piece:
    """Cost of one block on one rank: calls, parameter elements held, activation bytes saved
    for backward, transient bytes alive while it runs (``workspace``), and its work: matmul
    FLOPs and attention FLOPs of the forward, elementwise passes (elements read and written
    once, forward and backward together) with the size of the tensor each runs over."""

    calls: list[Call] = field(default_factory=list)
    params: int = 0
    saved: int = 0
    workspace: int = 0
    flops: int = 0
    attn_flops: int = 0
    # elementwise passes as (bytes of the tensor passed over, element passes) pairs: how fast a
    # pass runs may depend on the tensor's size (a cache, an allocator), which the planner's
    # host model decides
    elementwise: tuple[tuple[int, int], ...] = ()
    tensors: int = 0  # parameter tensors held (one message each where a step sends them one by one)
    # saves a tensor for backward whose bytes another piece counts (fc2's input is ReLU's output):
    # still a save, so activation checkpointing recomputes up to and through this piece
    saves: bool = False
    # module calls the piece stands for: a fixed host cost each (Python, dispatch, autograd),
    # which the planner's host model prices where it is not hidden behind the kernels
    modules: int = 0
    # of ``params`` / ``tensors``: experts split over ep, whose gradients are averaged (and
    # ZeRO-sharded) over the expert data parallel group edp rather than dp x sp
    edp_params: int = 0
    edp_tensors: int = 0

    @property
    def elems(self) -> int:
        """Element passes of every elementwise kernel, whatever the tensor size."""
        return sum(n for _, n in self.elementwise)

    @property
    def saves_any(self) -> bool:
        """Packs a tensor for backward (checkpointing's recompute runs at least this far)."""
        return bool(self.saved) or self.saves

    def __add__(self, other: "Piece") -> "Piece":
        return Piece(self.calls + other.calls, self.params + other.params, self.saved + other.saved,
                     max(self.workspace, other.workspace), self.flops + other.flops,
                     self.attn_flops + other.attn_flops, self.elementwise + other.elementwise,
                     self.tensors + other.tensors, self.saves or other.saves, self.modules + other.modules,
                     self.edp_params + other.edp_params, self.edp_tensors + other.edp_tensors)


# elementwise passes per element (forward + backward), as torch's CPU kernels run them (measured
# with torch.profiler): the loss over the logits, a LayerNorm, a bias add, an embedding lookup
LOSS_PASSES, NORM_PASSES, BIAS_PASSES, LOOKUP_PASSES = 12, 12, 2, 3


def elementwise(passes: int, n: int, e: int) -> dict:
    """Piece fields for ``passes`` elementwise passes over a tensor of ``n`` elements of ``e`` bytes."""
    total = passes * n
    return {"elementwise": ((n * e, total),) if total else ()}


def calls(phase, axes, kind, payload, p, times=1, after_save=False, counted=True, per_block=False) -> list[Call]:
    """``[Call(...)]``, or [] on a group of one rank."""
    return [Call(phase, tuple(axes), kind, int(payload), p, times, after_save, counted, per_block)] if p > 1 else []


def one_call_per_block(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` of one block with their ``per_block`` calls (partial gradients) merged into
    one all-reduce of their summed payload, as the block makes it."""
    grouped = [c for p in pieces for c in p.calls if c.per_block]
    if len(grouped) < 2:
        return pieces
    out = [dataclasses.replace(p, calls=[c for c in p.calls if not c.per_block]) for p in pieces]
    return out + [Piece([dataclasses.replace(grouped[0], payload=sum(c.payload for c in grouped))])]


def need(who: str, what: str, value: int, parts: int, rule: str) -> None:
    """Raise :class:`Illegal` unless ``parts`` divides ``value``."""
    if value % parts:
        raise Illegal(f"{who} needs {what} divisible by {rule}; got {value}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stat_bytes(e: int) -> int:
    """Statistics (LayerNorm, cross entropy) run in at least fp32."""
    return max(e, 4)


def vocab_loss(vocab_axes, q, batch_axes, parts, rows, v_local, e, batch_mean) -> Piece:
    """vocab_parallel_cross_entropy over ``vocab_axes`` (row max, then [sum_exp, target, sum]),
    plus the grid heads' batch mean: the target count and the local sum over the batch axes."""
    es = stat_bytes(e)
    out = calls("fwd", vocab_axes, "all_reduce", rows * es, q) + calls("fwd", vocab_axes, "all_reduce", 3 * rows * es, q)
    if batch_mean:
        out += calls("fwd", batch_axes, "all_reduce", es, parts) + calls("fwd", batch_axes, "all_reduce", e, parts)
    logits = rows * v_local * e
    return Piece(out, 0, logits + rows * (ID_BYTES + es) + ID_BYTES, workspace=2 * logits,
                 **elementwise(LOSS_PASSES, rows * v_local, e))


class Costs1D:
    """Megatron 1D: activations [rows, H] replicated over the tp group of p ranks."""

    mode = "1d"

    def __init__(self, tp: int, depth: int = 1, ep: int = 4):
        self.p, self.tp, self.ep, self.canonical = tp, tp, ep, None

    def batch_parts(self, placement) -> int:
        return 1

    def hidden_parts(self, placement) -> int:
        return 1

    def head_parts(self, placement) -> int:
        """Parts the attention heads are split into."""
        return self.p

    def inner_parts(self, placement) -> int:
        """Parts a column layer's output (the MLP's inner width) is split into."""
        return self.p

    def after(self, placement):
        return None

    def linear(self, n_in, n_out, rows, e, placement=None, *, style="column", bias=True, input_saved=True,
               chunks=1) -> Piece:
        """Column: out split, dX all-reduced in backward; row: in split, y all-reduced forward.
        ``chunks`` = p: Megatron sequence parallelism between the blocks (``rows`` is then the whole
        sequence's): a column layer's input is all-gathered from the sequence chunks (once per
        tensor read: ``input_saved`` False for the readers after the first, which share it) and
        its dX reduce-scattered back; a row layer reduce-scatters y into chunks (all-gathers dY),
        and its bias, added on the chunk, has its gradient summed over tp."""
        p, who = self.p, f"ParallelLinear1D({style})"
        flops = 2 * rows * n_in * n_out // p
        sequence = chunks > 1
        if style == "column":
            need(who, "out_features", n_out, p, f"tp={p}")
            if sequence:
                x = rows * n_in * e
                comm = calls("fwd", ("tp",), "all_gather", x, p) + calls("bwd", ("tp",), "reduce_scatter", x, p) \
                    if input_saved else []
            else:
                comm = calls("bwd", ("tp",), "all_reduce", rows * n_in * e, p)
            return Piece(comm, n_out // p * n_in + (n_out // p if bias else 0), rows * n_in * e if input_saved else 0,
                         flops=flops, tensors=1 + bias, saves=True, **elementwise(BIAS_PASSES, rows * n_out // p if bias else 0, e))
        need(who, "in_features", n_in, p, f"tp={p}")
        y = rows * n_out * e
        if sequence:
            comm = calls("fwd", ("tp",), "reduce_scatter", y, p, after_save=True) + calls("bwd", ("tp",), "all_gather", y, p)
            comm += calls("bwd", ("tp",), "all_reduce", n_out * self.ep, p, per_block=True) if bias else []
        else:
            comm = calls("fwd", ("tp",), "all_reduce", y, p, after_save=True)
        return Piece(comm, n_out * n_in // p + (n_out if bias else 0), rows * n_in // p * e if input_saved else 0,
                     flops=flops, tensors=1 + bias, saves=True,
                     **elementwise(BIAS_PASSES, ceil_div(rows, chunks) * n_out if bias else 0, e))

    def sequence_chunks(self, h, rows, e, chunks) -> tuple[Piece, Piece]:
        """(entering, leaving) Megatron sequence parallelism around the blocks: the first block
        keeps this rank's chunk of its replicated input (no communication forward, the gradient
        all-gathered backward); the last block's output is all-gathered."""
        x = rows * h * e
        return (Piece(calls("bwd", ("tp",), "all_gather", x, chunks)),
                Piece(calls("fwd", ("tp",), "all_gather", x, chunks)))

    def layer_norm(self, h, rows, e, placement=None, *, affine=True, bias=True, chunks=1) -> Piece:
        """Replicated: saves its input and the row mean / rstd. ``chunks`` = p: on this rank's
        sequence chunk (``rows`` of the whole sequence), its weight / bias gradients summed over tp."""
        n = int(affine) + int(affine and bias)
        rows = ceil_div(rows, chunks)
        return Piece(self.chunk_param_grads(h, n, chunks), n * h, rows * h * e + 2 * rows * e,
                     tensors=n, **elementwise(NORM_PASSES, rows * h, e))

    def chunk_param_grads(self, n, count, chunks) -> list[Call]:
        """The all-reduces over tp of ``count`` gradients of ``n`` elements each, computed on a
        sequence chunk (none without Megatron sequence parallelism); a block merges them
        (:func:`one_call_per_block`)."""
        return [c for _ in range(count) for c in calls("bwd", ("tp",), "all_reduce", n * self.ep, chunks, per_block=True)]

    def vocab_embedding(self, vocab, h, rows, e, placement=None) -> Piece:
        """Table rows split over tp (padded to ceil(V/p) each); partial lookups all-reduced."""
        return Piece(calls("fwd", ("tp",), "all_reduce", rows * h * e, self.p, after_save=True),
                     ceil_div(vocab, self.p) * h, rows * (ID_BYTES + MASK_BYTES), tensors=1,
                     **elementwise(LOOKUP_PASSES, rows * h, e))

    def hidden_embedding(self, n, h, ids, e, placement=None) -> Piece:
        """A small table (positions, token types) replicated on every tp rank."""
        return Piece([], n * h, ids * ID_BYTES, tensors=1, **elementwise(LOOKUP_PASSES, ids * h, e))

    def lm_head(self, vocab, h, rows, e, placement=None, *, tied=False) -> Piece:
        """Vocabulary-split logits [rows, ceil(V/p)]: copy_to on entry (dX all-reduced)."""
        logits = rows * ceil_div(vocab, self.p) * e
        return Piece(calls("bwd", ("tp",), "all_reduce", rows * h * e, self.p),
                     0 if tied else ceil_div(vocab, self.p) * h, rows * h * e, workspace=2 * logits,
                     flops=2 * rows * h * ceil_div(vocab, self.p), tensors=0 if tied else 1)

    def loss(self, vocab, rows, e, placement=None) -> Piece:
        return vocab_loss(("tp",), self.p, (), 1, rows, ceil_div(vocab, self.p), e, batch_mean=False)

    def dense(self, n_in, n_out, rows, e, placement=None, *, bias=True) -> Piece:
        """A replicated nn.Linear (poolers, an MLM head's transform): no communication."""
        return Piece([], n_in * n_out + (n_out if bias else 0), rows * n_in * e, flops=2 * rows * n_in * n_out,
                     tensors=1 + bias)

    def classifier(self, classes, h, rows, e, placement=None) -> Piece:
        return self.dense(h, classes, rows, e)

    def patch_embedding(self, image, patch, channels, h, batch, e, placement=None) -> Piece:
        """An image model's patch embeddings replicated: conv weight and bias, cls token, positions."""
        tokens = (image // patch) ** 2 + 1
        return Piece([], h * channels * patch * patch + 2 * h + tokens * h, batch * channels * image * image * e,
                     flops=2 * batch * (tokens - 1) * channels * patch * patch * h, tensors=4)

    def vocab_bias(self, vocab, rows, e, placement=None) -> Piece:
        return Piece([], ceil_div(vocab, self.p), 0, tensors=1)


class GridCosts:
    """What 2D, 2.5D and 3D share: LayerNorm, embeddings, classifier and loss over a layout."""

    mode = "2d"
    suffix = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}

    def __init__(self, sizes: dict[str, int], ep: int):
        self.sizes, self.ep = sizes, ep

    def size(self, *axes: str) -> int:
        n = 1
        for a in axes:
            n *= self.sizes[a]
        return n

    def batch_parts(self, placement: ActivationPlacement) -> int:
        return self.size(*placement.batch_axes)

    def hidden_parts(self, placement: ActivationPlacement) -> int:
        return self.size(placement.hidden_axis)

    def head_parts(self, placement: ActivationPlacement) -> int:
        return self.size(placement.hidden_axis)

    def inner_parts(self, placement: ActivationPlacement) -> int:
        return self.size(placement.hidden_axis)

    def _param_use(self, placement, local, full_block) -> list[Call]:
        """gather_hidden_param of a piece of ``local`` elements: gradient summed over the
        replica axes, gathered over the parameter axes into ``full_block`` elements."""
        ep, out = self.ep, []
        if placement.replica_axes:
            out += calls("bwd", placement.replica_axes, "all_reduce", local * ep, self.size(*placement.replica_axes))
        g = self.size(*placement.param_axes)
        out += calls("fwd", placement.param_axes, "all_gather", full_block * ep, g)
        return out + calls("bwd", placement.param_axes, "reduce_scatter", full_block * ep, g)

    def _block_param_grads(self, placement, n_local, count) -> list[Call]:
        """use_block_param (LayerNorm weight / bias, biases): gradient summed over the batch axes."""
        return calls("bwd", placement.batch_axes, "all_reduce", n_local * self.ep, self.batch_parts(placement),
                     times=count)

    def _split_params(self, who, what, h, placement) -> int:
        """q * size(param_axes) hidden chunks (q*q in 2D / 2.5D, q^3 in 3D), with the rule."""
        parts = self.hidden_parts(placement) * self.size(*placement.param_axes)
        need(who, what, h, parts, f"{'q*q*q' if self.mode == '3d' else 'q*q'}={parts}")
        return parts

    def layer_norm(self, h, rows, e, placement, *, affine=True, bias=True) -> Piece:
        """Mean and variance all-reduced over the hidden axis; one all-reduce of both row sums
        backward; weight / bias gradients summed over the batch axes. Saves xhat and rstd."""
        q = self.hidden_parts(placement)
        need(f"LayerNorm{self.suffix[self.mode]}", "normalized_shape", h, q, f"q={q}")
        es, hid = stat_bytes(e), (placement.hidden_axis,)
        n = (1 if affine else 0) + (1 if affine and bias else 0)
        out = calls("fwd", hid, "all_reduce", rows * es, q, times=2) + calls("bwd", hid, "all_reduce", 2 * rows * es, q)
        out += self._block_param_grads(placement, h // q, n) if n else []
        return Piece(out, n * h // q, rows * (h // q) * es + rows * es, tensors=n,
                     **elementwise(NORM_PASSES, rows * (h // q), e))

    def hidden_embedding(self, n, h, ids, e, placement) -> Piece:
        """Table cut into q * size(param_axes) hidden chunks, gathered in forward."""
        parts = self._split_params(f"Embedding{self.suffix[self.mode]}", "embedding_dim", h, placement)
        local, hl = n * h // parts, h // self.hidden_parts(placement)
        return Piece(self._param_use(placement, local, n * hl), local, ids * ID_BYTES, tensors=1,
                     **elementwise(LOOKUP_PASSES, ids * hl, e))

    def vocab_embedding(self, vocab, h, rows, e, placement) -> Piece:
        """Ids all-gathered over the vocabulary axis, masked lookup, partial embeddings
        reduce-scattered back; 3D also gathers the table over its second batch axis."""
        q = self.hidden_parts(placement)
        need(f"VocabParallelEmbedding{self.suffix[self.mode]}", "embedding_dim", h, q, f"q={q}")
        ep, vocab_axis = self.ep, placement.batch_axes[-1]
        sub_axes = tuple(a for a in placement.param_axes if a != vocab_axis)
        qv, sub = self.size(vocab_axis), self.size(*sub_axes)
        local = ceil_div(vocab, qv * sub) * (h // q)
        out = calls("fwd", (vocab_axis,), "all_gather", qv * rows * ID_BYTES, qv)
        if placement.replica_axes:
            out += calls("bwd", placement.replica_axes, "all_reduce", local * ep, self.size(*placement.replica_axes))
        out += calls("fwd", sub_axes, "all_gather", sub * local * ep, sub)
        out += calls("bwd", sub_axes, "reduce_scatter", sub * local * ep, sub)
        partial = qv * rows * (h // q) * e
        out += calls("fwd", (vocab_axis,), "reduce_scatter", partial, qv, after_save=True)
        out += calls("bwd", (vocab_axis,), "all_gather", partial, qv)
        return Piece(out, local, qv * rows * (ID_BYTES + MASK_BYTES), workspace=partial + sub * local * ep, tensors=1,
                     **elementwise(LOOKUP_PASSES, qv * rows * (h // q), e))

    def loss(self, vocab, rows, e, placement) -> Piece:
        """Per-target cross entropy over the head's vocabulary axis (the global mean is
        ``model.loss_reduction``'s)."""
        out = self.after_head(placement)
        q = self.hidden_parts(out)
        return vocab_loss((out.hidden_axis,), q, out.batch_axes, self.batch_parts(out), rows,
                          self.vocab_pad(vocab) // q, e, batch_mean=False)

    def classifier(self, classes, h, rows, e, placement) -> Piece:
        """Weight gathered like a table, partial logits all-reduced over the hidden axis."""
        parts = self._split_params(f"Classifier{self.suffix[self.mode]}", "in_features", h, placement)
        q = self.hidden_parts(placement)
        out = self._param_use(placement, classes * h // parts, classes * (h // q))
        out += calls("fwd", (placement.hidden_axis,), "all_reduce", rows * classes * e, q)
        out += self._block_param_grads(placement, classes, 1)
        return Piece(out, classes * h // parts + classes, rows * (h // q) * e + classes * (h // q) * self.ep,
                     flops=2 * rows * (h // q) * classes, tensors=2)

    def patch_embedding(self, image, patch, channels, h, batch, e, placement) -> Piece:
        """Conv weight and bias, cls token and positions each split and gathered like a table."""
        parts = self._split_params(f"PatchEmbedding{self.suffix[self.mode]}", "hidden_size", h, placement)
        need(f"PatchEmbedding{self.suffix[self.mode]}", "image_size", image, patch, f"patch_size={patch}")
        q = self.hidden_parts(placement)
        tensors = (h * channels * patch * patch, h, h, ((image // patch) ** 2 + 1) * h)
        out = [c for n in tensors for c in self._param_use(placement, n // parts, n // q)]
        saved = batch * channels * image * image * e + (h // q) * channels * patch * patch * self.ep
        rows = batch // self.batch_parts(placement)
        return Piece(out, sum(tensors) // parts, saved,
                     flops=2 * rows * (image // patch) ** 2 * channels * patch * patch * (h // q), tensors=len(tensors))

    def vocab_bias(self, vocab, rows, e, placement) -> Piece:
        """An MLM head's output bias, split like the logits; gradient summed over the batch axes."""
        out = self.after_head(placement)
        local = self.vocab_pad(vocab) // self.hidden_parts(out)
        return Piece(self._block_param_grads(out, local, 1), local, 0, tensors=1)

    def dense(self, n_in, n_out, rows, e, placement, *, bias=True) -> Piece:
        """The mode's linear, moved back to ``placement`` (3D) by TensorLayout.change_placement."""
        piece = self.linear(n_in, n_out, rows, e, placement, bias=bias)
        src = self.after(placement)
        return piece if src == placement else piece + self.change_placement(n_out, rows, e, src, placement)


class Costs2D(GridCosts):
    """2D (SUMMA on a q x q grid) and 2.5D (the same on each of d depth slices)."""

    def __init__(self, tp: int, depth: int = 1, ep: int = 4, mode: str = "2d"):
        q = round((tp // depth) ** 0.5)
        self.q, self.d, self.mode = q, depth, mode
        super().__init__({"tp_row": q, "tp_col": q, "tp_dep": depth}, ep)
        self.canonical = canonical_for(mode)

    def after(self, placement):
        return placement

    def after_head(self, placement):
        return placement

    def vocab_pad(self, vocab: int) -> int:
        return ceil_div(vocab, self.q) * self.q

    def _summa(self, phase, a_axes, a_bytes, b_axes, b_bytes, b_kind="broadcast") -> list[Call]:
        """q steps: a broadcast of ``a`` and a broadcast (or reduce) of ``b`` each."""
        q = self.q
        return calls(phase, a_axes, "broadcast", a_bytes, q, times=q) + calls(phase, b_axes, b_kind, b_bytes, q, times=q)

    def linear(self, n_in, n_out, rows, e, placement=None, *, style="column", bias=True, input_saved=True) -> Piece:
        """nn forward; nt (dX) and tn (dW) backward; 2.5D sums dW over depth."""
        q, d, placement = self.q, self.d, placement or self.canonical
        who = f"ParallelLinear{self.suffix[self.mode]}"
        need(who, "in_features", n_in, q, f"q={q}")
        need(who, "out_features", n_out, q, f"q={q}")
        x, w = rows * (n_in // q) * e, n_in * n_out // (q * q) * self.ep
        row, col = ("tp_col",), ("tp_row",)  # the ranks of a grid row vary tp_col
        out = self._summa("fwd", row, x, col, w) + self._summa("bwd", col, w, row, x, "reduce")
        out += self._summa("bwd", row, x, col, w, "reduce") + calls("bwd", ("tp_dep",), "all_reduce", w, d)
        out += self._block_param_grads(placement, n_out // q, 1) if bias else []
        return Piece(out, n_in * n_out // (q * q) + (n_out // q if bias else 0), x if input_saved else 0,
                     workspace=2 * (x + w), flops=2 * rows * n_in * n_out // q, tensors=1 + bias, saves=True,
                     **elementwise(BIAS_PASSES, rows * n_out // q if bias else 0, e))

    def lm_head(self, vocab, h, rows, e, placement=None, *, tied=False) -> Piece:
        """Logits x E^T by SUMMA nt; nn (dX) and tn (dE) backward."""
        q, d = self.q, self.d
        need(f"LMHead{self.suffix[self.mode]}", "in_features", h, q, f"q={q}")
        v_pad = self.vocab_pad(vocab)
        big_e, y = v_pad * h // (q * q) * self.ep, rows * (v_pad // q) * e
        row, col = ("tp_col",), ("tp_row",)
        out = self._summa("fwd", col, big_e, row, y, "reduce") + self._summa("bwd", row, y, col, big_e)
        out += self._summa("bwd", row, y, col, big_e, "reduce") + calls("bwd", ("tp_dep",), "all_reduce", big_e, d)
        return Piece(out, 0 if tied else v_pad * h // (q * q), rows * (h // q) * e, workspace=2 * y + 2 * big_e,
                     flops=2 * rows * h * v_pad // q, tensors=0 if tied else 1)


class Costs3D(GridCosts):
    """3D (Bian et al.) on a q x q x q cube; a linear maps placement (I, J | L) to (I, L | J)."""

    mode = "3d"

    def __init__(self, tp: int, depth: int = 1, ep: int = 4):
        q = round(tp ** (1 / 3))
        self.q, self.d = q, 1
        super().__init__({"tp_x": q, "tp_y": q, "tp_z": q}, ep)
        self.canonical = ActivationPlacement("3d", ("tp_x", "tp_y"), "tp_z")

    def after(self, placement):
        return swapped_3d(placement)

    def after_head(self, placement):
        return swapped_3d(placement)

    def vocab_pad(self, vocab: int) -> int:
        return ceil_div(vocab, self.q * self.q) * self.q * self.q

    def _cube(self, n_in, n_out, rows, e, placement) -> tuple[list[Call], int, int]:
        """(calls, saved bytes, partial-output bytes) of linear_3d: all-gather x over J and W
        over I, reduce-scatter y over L; the adjoints backward."""
        q, (i_axis, j_axis), l_axis = self.q, placement.batch_axes, placement.hidden_axis
        x, w, y = rows * (n_in // q) * e, n_in * n_out // q**3 * self.ep, rows * (n_out // q) * e
        out = calls("fwd", (j_axis,), "all_gather", q * x, q) + calls("fwd", (i_axis,), "all_gather", q * w, q)
        out += calls("fwd", (l_axis,), "reduce_scatter", q * y, q, after_save=True)
        out += calls("bwd", (l_axis,), "all_gather", q * y, q) + calls("bwd", (i_axis,), "reduce_scatter", q * w, q)
        return out + calls("bwd", (j_axis,), "reduce_scatter", q * x, q), q * x + q * w, q * y

    def linear(self, n_in, n_out, rows, e, placement=None, *, style="column", bias=True, input_saved=True) -> Piece:
        q, placement = self.q, placement or self.canonical
        need("ParallelLinear3D", "in_features", n_in, q, f"q={q}")
        need("ParallelLinear3D", "out_features", n_out, q * q, f"q*q={q * q}")
        out, saved, partial = self._cube(n_in, n_out, rows, e, placement)
        out += self._block_param_grads(swapped_3d(placement), n_out // q, 1) if bias else []
        return Piece(out, n_in * n_out // q**3 + (n_out // q if bias else 0), saved, workspace=partial,
                     flops=2 * rows * n_in * n_out // q, tensors=1 + bias,
                     **elementwise(BIAS_PASSES, rows * n_out // q if bias else 0, e))

    def lm_head(self, vocab, h, rows, e, placement=None, *, tied=False) -> Piece:
        q, placement = self.q, placement or self.canonical
        need("LMHead3D", "in_features", h, q, f"q={q}")
        v_pad = self.vocab_pad(vocab)
        out, saved, partial = self._cube(h, v_pad, rows, e, placement)
        return Piece(out, 0 if tied else v_pad * h // q**3, saved, workspace=partial + 2 * rows * (v_pad // q) * e,
                     flops=2 * rows * h * v_pad // q, tensors=0 if tied else 1)

    def change_placement(self, h, rows, e, src, dst) -> Piece:
        """TensorLayout.change_placement: gather the activation to full size, keep the ``dst`` block."""
        q, parts = self.q, self.batch_parts(src)
        out = calls("fwd", (src.hidden_axis,), "all_gather", rows * h * e, q)
        gathered = rows * h * e
        for a in reversed(src.batch_axes):  # gather_from over each batch axis
            gathered *= q
            out += calls("fwd", (a,), "all_gather", gathered, q)
        full = rows * parts * h * e
        for a in dst.batch_axes:  # scatter_to: backward all-gathers the gradient
            out += calls("bwd", (a,), "all_gather", full, q)
            full //= q
        out += calls("bwd", (dst.hidden_axis,), "all_gather", full, q)
        return Piece(out, 0, 0, workspace=2 * rows * parts * h * e)


def costs_of(mode: str, tp: int, tp_depth: int = 1, param_bytes: int = 4):
    """What each block of ``mode``'s layout costs on ``tp`` ranks (``tp_depth``: the 2.5D
    depth), without building it: the cost object whose methods (``linear``, ``layer_norm``,
    ``lm_head``, ...) give each block's collectives per mesh axis, parameter elements held,
    activation bytes saved and work. Parameters, their gradients and gathered tables travel in
    ``param_bytes`` per element. The planner prices layouts through it."""
    if mode == "1d":
        return Costs1D(tp, tp_depth, param_bytes)
    if mode == "3d":
        return Costs3D(tp, tp_depth, param_bytes)
    if mode in ("2d", "2.5d"):
        return Costs2D(tp, tp_depth, param_bytes, mode)
    raise ValueError(f"costs_of: tp_mode={mode!r} is not one of 1d, 2d, 2.5d, 3d")
