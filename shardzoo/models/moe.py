"""A plain mixture-of-experts block for a model of one's own: a top-k router and experts with
transformers' experts contract, so a plan splits it as it splits a transformers MoE model
(``"...experts": "experts"``, ``"...router": "router"``; docs/parallelize.md).

Plain torch only; nothing here knows of a mesh. The experts hold all E experts stacked:
``gate_up_proj`` [E, 2I, H] (gate rows, then up), ``down_proj`` [E, H, I], ``act_fn``, and
``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``; the serial
forward loops over the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """``weight`` [E, H]: hidden [T, H] -> (router logits [T, E], top-k weights [T, K], top-k
    expert indices [T, K]); the weights are the softmax probabilities of the chosen experts
    (in fp32), renormalized to sum to 1 over the K when ``normalize``."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, normalize: bool = True):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the {n_experts} experts")
        self.top_k, self.normalize = top_k, normalize
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(hidden.dtype), index


class Experts(nn.Module):
    """E SwiGLU experts, hidden H, inner I, stacked (module doc):
    ``down(act(gate(x)) * up(x))`` of each token's K experts, summed with their weights."""

    def __init__(self, hidden: int, inner: int, n_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, inner))
        self.act_fn = F.silu
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)  # [T, H]
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)  # the pairs routed to expert e
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # [n, H]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    """Router then experts: [b, s, H] -> [b, s, H], each token through its ``top_k`` of
    ``n_experts`` experts of inner width ``inner``. The latest forward's router logits [b*s, E]
    stay in ``router_logits`` for an auxiliary loss."""

    def __init__(self, hidden: int, inner: int, n_experts: int, top_k: int, normalize: bool = True):
        super().__init__()
        self.router = TopKRouter(hidden, n_experts, top_k, normalize)
        self.experts = Experts(hidden, inner, n_experts)
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        self.router_logits, weights, index = self.router(flat)
        return self.experts(flat, index, weights).reshape(b, s, h)
