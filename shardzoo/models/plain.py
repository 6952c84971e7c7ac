"""Plain modules the families share: multi-head self-attention with separate q, k, v
projections (BERT, ViT, OPT) and the two-layer MLP (GPT-2, BERT, ViT).

Plain torch only (nn.Linear, F.scaled_dot_product_attention); a family's plan splits them
(``q_proj`` / ``k_proj`` / ``v_proj`` / ``fc1`` column, ``out_proj`` / ``fc2`` row) and the
engine routes the SDPA call over sp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from shardzoo.models.masks import sdpa_mask


# the configs' activation names -> plain modules (a module, not a function, so the planner's walk
# sees what the MLP keeps for backward)
_ACTIVATIONS = {"gelu": lambda: nn.GELU(), "gelu_new": lambda: nn.GELU(approximate="tanh"),
                "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "relu": lambda: nn.ReLU()}
ACTIVATION_NAMES = tuple(sorted(_ACTIVATIONS))


def activation_module(name: str) -> nn.Module:
    """The element-wise activation named as in the configs (``hidden_act`` /
    ``activation_function``) as an nn.Module."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; use one of {list(ACTIVATION_NAMES)}")
    return _ACTIVATIONS[name]()


class Attention(nn.Module):
    """Self-attention ``out_proj(sdpa(q_proj(x), k_proj(x), v_proj(x)))``: [b, s, H] -> [b, s, H].

    Args: hidden, num_heads (head_dim = hidden / num_heads); causal; dropout: on the attention
    probabilities in training; bias: on all four projections."""

    def __init__(self, hidden: int, num_heads: int, *, causal: bool, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.causal, self.attention_dropout = causal, dropout
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden, bias=bias) for _ in range(4))

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, H]; key_padding_mask bool [b, s] (True = attend) or None."""
        q, k, v = (rearrange(p(x), "b s (h d) -> b h s d", d=self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        mask = sdpa_mask(key_padding_mask, causal=self.causal)  # None: no padding
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                           dropout_p=self.attention_dropout if self.training else 0.0)  # [b, h, s, d]
        return self.out_proj(rearrange(y, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``: [b, s, H] -> [b, s, H], inner width ``ffn``; ``act`` named as in the
    configs (gelu, gelu_new, relu, ...)."""

    def __init__(self, hidden: int, ffn: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.act = activation_module(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
