"""Tiny mixture-of-experts models drawn so that routing is decided: the routers' weights wide
(no near tie of the top-k scores that a parallel summation order could flip), the experts'
small."""

from __future__ import annotations

import torch
from torch import nn


def decided_routing(model: nn.Module, router_suffix: str = "mlp.gate.weight", expert_std: float = 0.1) -> nn.Module:
    """Redraw ``model``'s router weights (names ending ``router_suffix``) from N(0, 1) and its
    experts' from N(0, ``expert_std``), in place, from the current torch seed; returns it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(router_suffix):
                p.normal_(0.0, 1.0)
            elif "experts" in name:
                p.normal_(0.0, expert_std)
    return model


def tiny_moe(kind: str, seed: int = 0, router_logits: bool = True, layers: int = 2, vocab: int = 96):
    """A tiny transformers MoE causal LM ``kind`` (mixtral, qwen3_moe, qwen2_moe, olmoe; 4 experts,
    top 2, ``layers`` blocks, fp32) with random weights from ``seed``; the routers drawn wide
    (std 1) so no token's top-2 is a near tie that rounding could flip. ``router_logits``: the
    config's output_router_logits (the aux loss joins the loss when labels are given)."""
    import transformers

    common = dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab, max_position_embeddings=64, attn_implementation="sdpa",
                  num_experts_per_tok=2, output_router_logits=router_logits, router_aux_loss_coef=0.1,
                  experts_implementation="eager")  # its loop over experts runs in fp64 too (the exact twin)
    if kind == "mixtral":
        cls, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=16, num_local_experts=4, **common)
    elif kind == "qwen3_moe":  # normalized top-k
        cls, config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            intermediate_size=32, moe_intermediate_size=16, num_experts=4, norm_topk_prob=True, head_dim=8, **common)
    elif kind == "qwen2_moe":  # a shared expert behind a sigmoid gate, top-k not renormalized
        cls, config = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
            norm_topk_prob=False, **common)
    else:  # OLMoE: q / k norms over the projections' width, top-k not renormalized
        cls, config = transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            intermediate_size=16, num_experts=4, norm_topk_prob=False, **common)
    torch.manual_seed(seed)
    model = cls(config).float().train()
    return decided_routing(model)
