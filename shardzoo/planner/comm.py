"""Communication that does not depend on the tp layout, and adding calls up into bytes and
messages per group.

* sequence parallelism over ``sp``: ring attention (K, V passed round the ring) and Ulysses
  (all-to-alls trading the sequence shard for a head shard);
* pipeline p2p over ``pp``: each stage sends its output forward and its input gradient back;
* the gradient reduction over ``dp x sp`` per ZeRO stage: DDP's all-reduce (stages 0 and 1),
  ZeroRedundancyOptimizer's parameter broadcasts (stage 1), and the reduce-scatter of gradients
  with the all-gather of parameters (FSDP2, stages 2 and 3; per block and pass in stage 3). A
  model made by ``shardzoo.parallelize`` averages every gradient over sp in its own backward
  (one all-reduce per parameter tensor, parallel/sp_grads.py), so its stages 0 and 1 reduce
  over dp only;
* the tied-embedding sync between the first and last pipeline stage.

Bytes follow ``shardzoo.comm.accounting`` (the ring model) through ``CommRecord`` itself, so a
predicted byte is counted exactly as the counter counts a sent one.
"""

from __future__ import annotations

from fractions import Fraction

from shardzoo.comm.accounting import CommRecord
from shardzoo.planner.block_costs import ID_BYTES, Call, Illegal, Piece, calls, elementwise

DP_AXES = ("dp", "sp")  # data_parallel reduces gradients over the dp x sp group
DDP_AXES = (DP_AXES, ("dp",))  # DDP's groups: dp x sp, or dp where backward() averages over sp
DDP_BUCKET_BYTES = 25 << 20  # torch DDP's default bucket_cap_mb
RING_MERGE_PASSES = 6  # per ring step: the log-sum-exp merge of out and lse, the dQ / dK / dV sums
ULYSSES_COPY_PASSES = 8  # the head / sequence regrouping copies of q, k, v and out, both ways

# messages (latency terms) one call waits for in turn, as each backend runs it. The bytes stay
# the ring model's (CommRecord) on both. NCCL runs every collective here as a ring (or a chain,
# pipelined in chunks): a broadcast or reduce passes its data down p - 1 hops. Gloo runs the same
# ring algorithms, except its broadcast, which goes down a binomial tree (ceil(log2 p) rounds).
_RING_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1,
               "all_to_all": lambda p: p - 1, "broadcast": lambda p: p - 1, "reduce": lambda p: p - 1,
               "send": lambda p: 1}
STEPS = {"nccl": _RING_STEPS, "gloo": _RING_STEPS | {"broadcast": lambda p: (p - 1).bit_length()}}


_FACTORS: dict[tuple[str, int], Fraction] = {}
_FLOAT_FACTORS: dict[tuple[str, int, str], tuple[float, int]] = {}
_SCALED: dict[tuple[str, int, int], int] = {}


def byte_factor(kind: str, p: int) -> Fraction:
    """Bytes one rank sends per payload byte of a ``kind`` call on ``p`` ranks (CommRecord's)."""
    key = (kind, p)
    if key not in _FACTORS:
        _FACTORS[key] = CommRecord(kind, 1, p).bytes_sent
    return _FACTORS[key]


def call_bytes(call: Call) -> Fraction:
    """Bytes one rank sends for ``call`` (all its repeats)."""
    return byte_factor(call.kind, call.group_size) * call.payload * call.times


class Traffic:
    """Calls added up: per (phase, group axes, kind, group size, counted), the payload bytes
    and the number of calls, as integers; bytes sent follow exactly (``byte_factor``)."""

    __slots__ = ("sums",)

    def __init__(self):
        self.sums: dict[tuple, list[int]] = {}

    def add(self, call_list, times: int = 1, phase: str | None = None) -> "Traffic":
        sums = self.sums
        for c in call_list:
            key = (phase or c.phase, c.axes, c.kind, c.group_size, c.counted)
            entry = sums.get(key)
            if entry is None:
                entry = sums[key] = [0, 0]
            entry[0] += c.payload * c.times * times
            entry[1] += c.times * times
        return self

    def merge(self, other: "Traffic", times: int = 1, phase: str | None = None) -> "Traffic":
        sums = self.sums
        for (ph, axes, kind, p, counted), (payload, n) in other.sums.items():
            key = (phase or ph, axes, kind, p, counted)
            entry = sums.get(key)
            if entry is None:
                entry = sums[key] = [0, 0]
            entry[0] += payload * times
            entry[1] += n * times
        return self

    def bytes_by(self, part=lambda key: None) -> dict:
        """Exact bytes sent, grouped by ``part(key)`` (key: phase, axes, kind, size, counted)."""
        payloads: dict = {}
        for key, (payload, _) in self.sums.items():
            k = (part(key), key[2], key[3])
            payloads[k] = payloads.get(k, 0) + payload
        out: dict = {}
        for (k, kind, p), payload in payloads.items():  # one exact product per kind and group size
            out[k] = out.get(k, Fraction(0)) + byte_factor(kind, p) * payload
        return out

    def total(self) -> Fraction:
        return self.bytes_by().get(None, Fraction(0))

    def scaled_total(self, denominator: int) -> int:
        """``total() * denominator`` in integers, for a denominator every group size divides."""
        out = 0
        for (_, _, kind, p, _), (payload, _) in self.sums.items():
            f = _SCALED.get((kind, p, denominator))
            if f is None:
                scaled = byte_factor(kind, p) * denominator
                if scaled.denominator != 1:
                    raise ValueError(f"group size {p} does not divide {denominator}")
                f = _SCALED[(kind, p, denominator)] = int(scaled)
            out += f * payload
        return out

    def messages(self, backend: str) -> int:
        """Messages (latency terms) of every call, as the time model counts them on ``backend``."""
        return sum(n for _, _, n in self.links(backend))

    def links(self, backend: str):
        """(axes, bytes as a float, messages) per entry, for the time model: messages per call
        as ``backend`` ("nccl" or "gloo", a key of ``STEPS``) runs it."""
        steps = STEPS[backend]
        for (_, axes, kind, p, _), (payload, n) in self.sums.items():
            f = _FLOAT_FACTORS.get((kind, p, backend))
            if f is None:
                f = _FLOAT_FACTORS[(kind, p, backend)] = (float(byte_factor(kind, p)), steps[kind](p))
            yield axes, f[0] * payload, f[1] * n


# -- sequence parallelism ---------------------------------------------------------------------
ATTENTION_KERNELS = ("flash", "materialized")
SCORE_PASSES = 5  # over the score matrix, forward + backward: softmax 1 + 2, dropout on the probabilities 1 + 1


def materialized_attention(batch, heads, seq, head_dim, e, kv_heads=None) -> Piece:
    """Attention as two batched matmuls around a softmax over the whole [seq, seq] score
    matrix (Megatron-LM's kernels of Narayanan et al. 2021, and torch's math kernel): the
    matmuls run the whole square whatever the mask, at the matmul rate; softmax and dropout
    stream the scores through memory; the probabilities and their dropout mask are saved."""
    kvh = heads if kv_heads is None else kv_heads
    q_bytes, kv = batch * heads * seq * head_dim * e, batch * kvh * seq * head_dim * e
    scores = batch * heads * seq * seq
    return Piece([], 0, 2 * q_bytes + 2 * kv + scores * (e + 1), flops=4 * scores * head_dim,
                 **elementwise(SCORE_PASSES, scores, e))


def attention_core(batch, heads, seq, head_dim, e, sp, sp_mode, mask=False, causal=False, kv_heads=None,
                   kernel: str = "flash") -> Piece:
    """Attention of this rank's ``heads`` heads over ``seq`` local tokens of ``batch`` rows;
    ``kv_heads``: this rank's k / v heads (grouped-query attention; None: ``heads``).

    Saved (every sp_mode): q, k, v, the output and the fp32 log-sum-exp (flash attention never
    keeps a score matrix). Ring: K, V (+ mask) take sp-1 hops forward; backward K, V take sp-1
    hops and dK, dV (fp32) sp hops; only the kv heads travel. Ulysses: q, k, v and out cross one
    all-to-all each way; k and v carry the kv heads when sp divides them, one head per rank when
    they divide sp, and are repeated to the q heads otherwise (sdpa_mode.run_sequence_attention)."""
    if kernel == "materialized":
        if sp > 1:
            raise Illegal(f"sp={sp}: the materialized attention kernel is priced without sequence parallelism; "
                          f"use sp=1 or the flash kernel")
        return materialized_attention(batch, heads, seq, head_dim, e, kv_heads)
    acc = 8 if e == 8 else 4
    kvh = heads if kv_heads is None else kv_heads
    q_bytes = batch * heads * seq * head_dim * e
    kv = batch * kvh * seq * head_dim * e
    mask_bytes = batch * seq if mask else 0
    saved = 2 * q_bytes + 2 * kv + batch * heads * seq * acc + mask_bytes
    elements = batch * heads * seq * head_dim
    # scores and values against every key of the sequence; a causal block kernel skips half
    work = dict(attn_flops=int(4 * batch * heads * seq * seq * sp * head_dim * (0.5 if causal else 1.0)))
    if sp == 1:
        return Piece([], 0, saved, **work)
    axes = ("sp",)
    if sp_mode == "ring":
        grads = batch * kvh * seq * head_dim * acc
        out = calls("fwd", axes, "send", kv, sp, times=2 * (sp - 1)) + calls("bwd", axes, "send", kv, sp, times=2 * (sp - 1))
        out += calls("bwd", axes, "send", grads, sp, times=2 * sp)
        if mask:
            out += calls("fwd", axes, "send", mask_bytes, sp, times=sp - 1)
            out += calls("bwd", axes, "send", mask_bytes, sp, times=sp - 1)
        return Piece(out, 0, saved, **elementwise(RING_MERGE_PASSES * sp, elements, e), **work)
    sent = ulysses_kv_heads(heads, kvh, sp)
    # the kernel runs on k and v repeated to the q heads (ulysses_attention), and fewer kv heads
    # than sp ranks are first picked out per rank (index_select keeps its int64 index)
    saved = 4 * q_bytes + batch * heads * seq * acc + mask_bytes + (2 * ID_BYTES * sp if sent == sp != kvh else 0)
    if sent == heads:
        out = calls("fwd", axes, "all_to_all", q_bytes, sp, times=4) + calls("bwd", axes, "all_to_all", q_bytes, sp, times=4)
    else:
        kv_sent = batch * sent * seq * head_dim * e
        out = [c for phase in ("fwd", "bwd") for c in calls(phase, axes, "all_to_all", q_bytes, sp, times=2)
               + calls(phase, axes, "all_to_all", kv_sent, sp, times=2)]
    if mask:  # gather_padding_mask: the full-sequence mask, uint8
        out += calls("fwd", axes, "all_gather", batch * seq * sp, sp)
    return Piece(out, 0, saved, **elementwise(ULYSSES_COPY_PASSES, elements, e), **work)


def ulysses_kv_heads(heads: int, kv_heads: int, sp: int) -> int:
    """Heads of the k / v tensors Ulysses' all-to-alls carry on one rank: its kv heads when sp
    divides them, one per sp rank when they divide sp, else repeated to the q heads."""
    if kv_heads % sp == 0:
        return kv_heads
    return sp if sp % kv_heads == 0 else heads


# -- pipeline, data parallelism, ZeRO ----------------------------------------------------------
def pipeline_p2p(boundary_bytes: int, pp: int, first: bool, last: bool, virtual_stages: int = 1) -> list[Call]:
    """Per micro-batch: the stage output goes forward, the input gradient back (torch
    pipelining's PipelineStage; torch.distributed direct, so comm.count does not see it). With
    ``virtual_stages`` v > 1 (interleaved 1F1B) a rank holds v chunks and each chunk sends,
    except the first rank's first chunk backward and the last rank's last chunk forward."""
    v = virtual_stages
    fwd, bwd = v - (1 if last else 0), v - (1 if first else 0)
    out = calls("fwd", ("pp",), "send", boundary_bytes, pp, times=fwd, counted=False) if fwd else []
    return out + (calls("bwd", ("pp",), "send", boundary_bytes, pp, times=bwd, counted=False) if bwd else [])


def _split_calls(kind: str, total: int, n: int, parts: int, axes=DP_AXES, phase="step",
                 counted=False) -> list[Call]:
    """``parts`` calls of ``kind`` over ``axes`` (dp x sp) whose payloads add up to ``total``
    bytes (a call's bytes are linear in its payload, so only the count of calls is a guess)."""
    base, rest = divmod(total, parts)
    out = calls(phase, axes, kind, base, n, times=parts - rest, counted=counted) if parts > rest else []
    return out + (calls(phase, axes, kind, base + 1, n, times=rest, counted=counted) if rest else [])


def sp_grad_average(grad_bytes: int, sp: int, tensors: int) -> list[Call]:
    """Per micro-batch: a ``parallelize``'d model's backward all-reduces each parameter
    tensor's gradient over sp (``tensors`` of them, ``grad_bytes`` in all) through
    shardzoo.comm (counted); parallel/sp_grads.py."""
    return _split_calls("all_reduce", grad_bytes, sp, max(1, tensors), ("sp",), "bwd", True) if sp > 1 else []


def tied_sync(table_bytes: int) -> list[Call]:
    """pipeline.sync_tied_grads: the tied table's gradient summed by the first and last stage."""
    return calls("step", ("pp",), "all_reduce", table_bytes, 2, counted=False)


def dp_reduction(param_bytes: int, grad_bytes: int, n: int, zero: int, block_bytes: list[int],
                 tensors: int = 1, axes: tuple[str, ...] = DP_AXES) -> list[Call]:
    """The step's gradient reduction over dp x sp (``n`` ranks; ``axes``: ("dp",) for stages 0
    and 1 of a model whose backward averages over sp itself) for ZeRO stage ``zero``.

    0: DDP all-reduces every gradient (buckets of 25 MiB). 1: the same DDP all-reduce, then
    ZeroRedundancyOptimizer broadcasts every updated parameter from the rank that owns it, one
    broadcast per parameter tensor (``tensors`` of them, ``param_bytes`` in all). 2: FSDP2
    reduce-scatters the gradients (fp32, ``grad_bytes``) and all-gathers the parameters once
    per step (the ZeRO paper's 2*Psi, as DDP). 3: FSDP2 all-gathers each block's parameters
    before its forward and again before its backward (``block_bytes``: full bytes of each
    sharded unit) and reduce-scatters gradients."""
    if n == 1:
        return []
    if zero <= 1:
        out = _split_calls("all_reduce", grad_bytes, n, max(1, -(-grad_bytes // DDP_BUCKET_BYTES)), axes)
        return out + (_split_calls("broadcast", param_bytes, n, max(1, tensors), axes) if zero == 1 else [])
    out = calls("step", DP_AXES, "reduce_scatter", grad_bytes, n, counted=False)
    if zero < 3:
        return out + calls("step", DP_AXES, "all_gather", param_bytes, n, counted=False)
    for b in sorted(set(block_bytes)):
        k = block_bytes.count(b)
        out += calls("fwd", DP_AXES, "all_gather", b, n, times=k, counted=False)
        out += calls("bwd", DP_AXES, "all_gather", b, n, times=k, counted=False)
    return out


def edp_reduction(layer_bytes: list[int], edp: int, zero: int, tensors: int, pipelined: bool = False) -> list[Call]:
    """The gradient reduction of the experts split over ep (``layer_bytes``: this rank's expert
    bytes of each MoE layer, ``tensors`` tensors in all) over the expert data parallel group
    edp of ``edp`` ranks (layers/experts.py, parallel/data_parallel.py). 0 and 1: each tensor's
    gradient all-reduced by a hook of its layer in every backward (shardzoo.comm: counted); in
    a pipeline (``pipelined``) one all-reduce of them all once per step, after the schedule
    (parallel/pipeline_grads.py).
    2: FSDP2 over edp reduce-scatters the gradients and all-gathers the parameters once per
    step. 3: each layer's experts are a unit of their own, all-gathered before its forward and
    again before its backward."""
    total = sum(layer_bytes)
    if edp == 1 or total == 0:
        return []
    if zero <= 1 and pipelined:
        return calls("step", ("edp",), "all_reduce", total, edp, counted=False)
    if zero <= 1:
        return _split_calls("all_reduce", total, edp, max(1, tensors), ("edp",), "bwd", True)
    out = calls("step", ("edp",), "reduce_scatter", total, edp, counted=False)
    if zero < 3:
        return out + calls("step", ("edp",), "all_gather", total, edp, counted=False)
    for b in sorted(set(layer_bytes)):
        k = layer_bytes.count(b)
        out += calls("fwd", ("edp",), "all_gather", b, edp, times=k, counted=False)
        out += calls("bwd", ("edp",), "all_gather", b, edp, times=k, counted=False)
    return out
