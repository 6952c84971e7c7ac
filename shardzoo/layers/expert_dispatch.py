"""Dropless all-to-all dispatch of routed tokens to the experts split over an ep group.

Each rank holds ``n_local = n_experts / ep`` whole experts (rank i: experts i*n_local ..
(i+1)*n_local - 1). For the T tokens of this rank, each routed to K experts:

1. the T*K (token, expert) pairs are sorted by expert (stable), the counts per expert [E]
   exchanged with an even all-to-all (each rank learns how many rows it gets from each rank
   for each of its experts);
2. the sorted rows go to the experts' ranks with an uneven all-to-all (``all_to_all_v``);
3. the received rows are put in local expert order, computed by the caller's function, put
   back in arrival order;
4. a second uneven all-to-all returns them, and each token's K outputs are summed weighted by
   the routing weights.

No row is dropped unless ``capacity`` is given: then each rank sends each expert at most
``capacity`` of its pairs (the first in token order), and the pairs over it contribute zero.
Backward runs the two all-to-alls in reverse (collectives.all_to_all_v). Bytes this rank
sends per layer, forward and backward: ``8 * E * (ep-1)/ep`` for the counts (int64), plus
``2 * H * itemsize * (s + r)`` for the rows, with ``s`` the pairs of its tokens routed to
another rank's experts (dispatch forward, combine backward) and ``r`` the pairs other ranks
route to its experts (combine forward, dispatch backward). With tokens routed uniformly,
``s = r = T*K*(ep-1)/ep``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardzoo.comm import collectives, ops


@dataclass
class Route:
    """Where the pairs of one dispatch went: ``order`` sorts the T*K pairs by expert (the sent
    ones: each pair's (token, k) slot), ``keep`` the sorted pairs sent (None: all),
    ``send`` / ``recv`` the rows per member, ``perm`` the received rows in local expert order and
    ``sizes`` the rows per local expert; ``group`` the ep group."""

    group: object
    order: torch.Tensor
    keep: torch.Tensor | None
    send: list[int]
    recv: list[int]
    perm: torch.Tensor
    sizes: list[int]


def _within_capacity(sorted_experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Mask of the sorted pairs whose place among their expert's pairs is below ``capacity``."""
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(sorted_experts.numel(), device=sorted_experts.device) - starts[sorted_experts]
    return place < capacity


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, n_experts: int, group,
             capacity: int | None = None) -> tuple[torch.Tensor, Route]:
    """Send each routed row to its expert's rank: ``hidden`` [T, H], ``top_k_index`` [T, K]
    (global expert ids) -> (rows for this rank's experts in local expert order [R, H], route)."""
    ep = ops.group_size(group)
    n_local = n_experts // ep
    k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    counts = torch.bincount(experts, minlength=n_experts)
    keep = None
    if capacity is not None:
        keep = _within_capacity(sorted_experts, counts, capacity)
        order, sorted_experts = order[keep], sorted_experts[keep]
        counts = counts.clamp(max=capacity)
    recv_counts = ops.all_to_all(counts, group, 0, 0).view(ep, n_local)  # [source, local expert]
    # the split sizes the uneven all-to-all and the grouped matmul need, read in one host sync
    sizes = torch.cat([counts.view(ep, n_local).sum(1), recv_counts.sum(1), recv_counts.sum(0)]).tolist()
    send, recv, per_expert = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    received = collectives.all_to_all_v(hidden[torch.div(order, k, rounding_mode="floor")], group, send, recv)
    local = torch.arange(n_local, device=hidden.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.argsort(local, stable=True)
    route = Route(group, order, keep, send, recv, perm, per_expert)
    return received[perm], route


def combine(expert_out: torch.Tensor, route: Route, top_k_weights: torch.Tensor, n_tokens: int,
            dtype: torch.dtype) -> torch.Tensor:
    """The rows of :func:`dispatch` computed by the experts ([R, H], local expert order) back to
    their tokens, weighted: -> [T, H] in ``dtype``, sum over k of weight * expert output."""
    inverse = torch.empty_like(route.perm)
    inverse[route.perm] = torch.arange(route.perm.numel(), device=route.perm.device)
    back = collectives.all_to_all_v(expert_out[inverse], route.group, route.recv, route.send)
    # each pair's row to its (token, k) slot, then the weighted sum over k: autograd keeps one
    # [T*K, H] tensor (for the weights' gradient), where an index_add would keep its source too
    k, width = top_k_weights.shape[-1], expert_out.shape[-1]
    alloc = torch.empty if route.keep is None else torch.zeros  # pairs over capacity add zero
    pairs = alloc(n_tokens * k, width, dtype=back.dtype, device=back.device)
    pairs[route.order] = back
    return (pairs.view(n_tokens, k, width) * top_k_weights.unsqueeze(-1)).sum(1).to(dtype)


def run_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int,
                group, compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
                capacity: int | None = None) -> torch.Tensor:
    """``hidden`` [T, H] through the experts split over ``group``: dispatch, ``compute(rows [R,
    H] in local expert order, rows per local expert) -> [R, H]``, combine -> [T, H]."""
    rows, route = dispatch(hidden, top_k_index, n_experts, group, capacity)
    out = compute(rows, route.sizes)
    return combine(out, route, top_k_weights, hidden.shape[0], hidden.dtype)
