"""Fused kernels: Triton for CUDA tensors, each with a pure-torch reference of the same signature,
wrapped in a thin autograd.Function. With ``backend="auto"`` CPU tensors run the reference,
except attention, which runs torch's fused CPU flash kernel ("aten") unless dropout is on
(its stateless mask needs the reference). Importing this package never requires Triton
(see ``HAS_TRITON``)."""
from ._triton import HAS_TRITON
from .bias_gelu import BiasGeluFunction, bias_gelu, bias_gelu_backward, bias_gelu_forward
from .cross_entropy import CrossEntropyFunction, cross_entropy, cross_entropy_grad, cross_entropy_partials
from .flash_attention import (
    FlashAttentionFunction,
    attention_block_backward,
    attention_block_forward,
    draw_dropout_seed,
    flash_attention,
)
from .layer_norm import LayerNormFunction, fused_layer_norm, layer_norm_backward, layer_norm_forward

__all__ = [
    "HAS_TRITON",
    "attention_block_forward",
    "attention_block_backward",
    "FlashAttentionFunction",
    "flash_attention",
    "draw_dropout_seed",
    "layer_norm_forward",
    "layer_norm_backward",
    "LayerNormFunction",
    "fused_layer_norm",
    "bias_gelu_forward",
    "bias_gelu_backward",
    "BiasGeluFunction",
    "bias_gelu",
    "cross_entropy_partials",
    "cross_entropy_grad",
    "CrossEntropyFunction",
    "cross_entropy",
]
