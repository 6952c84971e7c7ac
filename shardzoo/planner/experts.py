"""Mixture-of-experts layers as the planner prices them: the 'experts' and 'router' styles
(parallel/styles/experts.py) on one rank, and where the expert axes of a mesh lie.

An experts module (transformers' experts contract: ``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) on a mesh with ``ep`` = P ranks per ep group holds E / P whole experts,
``3 E I H / P`` elements. Its T tokens (this rank's: the sequence chunk under Megatron sequence
parallelism), each routed to K experts, are priced under uniform routing: each token's K
copies land uniformly over the E experts, so a rank sends and receives ``T K (P - 1) / P`` of
the pairs and computes ``T K`` pairs, whatever P is. Per layer and micro-batch (the dropless
dispatch, layers/expert_dispatch.py; bytes as docs/parallelize.md gives them):

* forward: the counts per expert, an all-to-all of E int64 over ep; the routed rows out and
  the results back, two all-to-alls of ``T K H e`` bytes over ep (``(P - 1) / P`` of them
  leave the rank: ``s = r = T K (P - 1) / P`` pairs); backward: the same two again;
* FLOPs: ``6 T K H I`` forward (gate, up and down of each pair), not ``6 T E H I``;
* under Megatron sequence parallelism (1d, tp > 1) the experts' weight gradients, partial
  over tp, all-reduced over tp (one call per tensor).

Their gradients are averaged over edp = dp x sp / P (``comm.edp_reduction``), not dp x sp.
"""

from __future__ import annotations

from types import SimpleNamespace

from shardzoo.parallel.styles import STYLES
from shardzoo.planner.block_costs import ID_BYTES, Illegal, Piece, calls, elementwise
from shardzoo.planner.model import ADD_PASSES, GELU_PASSES

COUNT_BYTES = 8  # the counts per expert are int64
MUL_PASSES = 3  # act(gate) * up, forward + backward (an estimate)
MOVE_PASSES = 11  # the rows gathered, put in expert order and back, weighted and summed, fwd + bwd (an estimate)
SOFTMAX_PASSES = 3  # the router's softmax over its logits, forward + backward (an estimate)


def experts_shape(module) -> tuple[int, int, int]:
    """(experts E, inner width I, hidden H) of a module with the experts contract."""
    e, two_i, h = module.gate_up_proj.shape
    return e, two_i // 2, h


def check_experts(name: str, module, ep: int, mode: str) -> None:
    """Raise :class:`Illegal` where parallelize's 'experts' style refuses ``module`` on this ep
    and tp_mode (its own rule), or where a grid layout would split the hidden it reads."""
    try:
        STYLES["experts"].check_mesh(name, module, SimpleNamespace(ep_size=ep), mode)
    except ValueError as err:
        raise Illegal(str(err)) from None
    if mode != "1d":
        raise Illegal(f"{name}: the experts module reads whole hidden vectors, and tp_mode={mode!r} splits them over "
                      f"its grid; MoE models are priced in tp_mode='1d'")


def experts_piece(ctx, step) -> list[Piece]:
    """The experts of one MoE layer on this rank (module doc), and the residual add after them."""
    n_experts, inner, hidden = experts_shape(step.module)
    ep, e, pb = ctx.b.ep, ctx.b.e, ctx.costs.ep  # costs.ep: bytes per parameter element
    tokens, k = ctx.chunk_rows, step.top_k or 1
    pairs = tokens * k
    local = 3 * n_experts // ep * inner * hidden
    out = []
    if ep > 1:
        rows = pairs * hidden * e
        out += calls("fwd", ("ep",), "all_to_all", COUNT_BYTES * n_experts, ep)
        out += calls("fwd", ("ep",), "all_to_all", rows, ep, times=2)
        out += calls("bwd", ("ep",), "all_to_all", rows, ep, times=2)
    if ctx.chunks > 1:  # Megatron sequence parallelism: partial weight gradients summed over tp
        for part in (2 * local // 3, local // 3):  # gate_up_proj, down_proj
            out += calls("bwd", ("tp",), "all_reduce", part * pb, ctx.chunks)
    # saved (an estimate, per routed pair): the rows in, gate|up, act(gate), the product and
    # the rows back in the activation dtype; the routing weight; three int64 index vectors
    saved = pairs * (2 * hidden + 4 * inner + 1) * e + 3 * pairs * ID_BYTES
    passes = ((pairs * inner * e, (GELU_PASSES + MUL_PASSES) * pairs * inner),
              (pairs * hidden * e, MOVE_PASSES * pairs * hidden))
    piece = Piece(out, local, saved, flops=6 * pairs * hidden * inner, elementwise=tuple(p for p in passes if p[1]),
                  tensors=2, edp_params=local if ep > 1 else 0, edp_tensors=2 if ep > 1 else 0)
    return [piece, Piece(**elementwise(ADD_PASSES, tokens * hidden, e))]


def router_piece(ctx, step) -> list[Piece]:
    """The router of one MoE layer, whole on every rank: a linear onto the E expert scores of
    this rank's T tokens (its input and its fp32 probabilities saved); under Megatron sequence
    parallelism its gradients, partial over tp, all-reduced over tp."""
    params = list(step.module.parameters())
    n = sum(p.numel() for p in params)
    tokens, e = ctx.chunk_rows, ctx.b.e
    scores = n // step.width if step.width else 0
    out = [c for p in params for c in calls("bwd", ("tp",), "all_reduce", p.numel() * ctx.costs.ep, ctx.chunks)]
    return [Piece(out, n, tokens * step.width * e + tokens * scores * 4, flops=2 * tokens * n, tensors=len(params),
                  **elementwise(SOFTMAX_PASSES, tokens * scores, e))]


def expert_axis_strides(dp: int, pp: int, sp: int, tp: int, ep: int) -> dict[str, tuple[int, int]]:
    """The "ep" and "edp" groups as (stride, size) of the slowest global axis they span, for
    the time model's node test (time.link). The dp x sp ranks (sp fastest, stride tp; dp
    stride pp sp tp) are cut into ep groups of ``ep`` consecutive ones; an edp group takes
    one rank of each."""
    dp_stride, edp = pp * sp * tp, dp * sp // ep
    out = {"ep": (dp_stride, -(-ep // sp)) if ep > sp else (tp, ep)}
    last = (edp - 1) * ep  # the edp group's last member in dp x sp
    out["edp"] = (dp_stride, last // sp + 1) if last >= sp else (ep * tp, edp)
    return out
