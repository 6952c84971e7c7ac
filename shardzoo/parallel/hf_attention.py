"""Sequence parallelism for transformers models through their ``AttentionInterface``.

shardzoo's ring and Ulysses attention are registered as attention implementations
(``shardzoo_ring``, ``shardzoo_ulysses``) and the model's config is switched to one of them;
no forward function of transformers is replaced. transformers builds no mask for an
implementation it has no mask function for, so the attention is causal by the module's
``is_causal`` and takes the padding mask the input hook split for this rank
(inputs.Parallelized.key_padding_mask), or the packed documents' boundaries (``cu_seqlens``).
The q heads are this rank's; fewer kv heads (grouped-query attention) travel as they are, and
only the kv heads go round the ring. A sliding window (Mistral, Qwen2's
``use_sliding_window``) goes to the ring or Ulysses as their ``window``: the ring masks by global
positions and skips the blocks wholly outside it, Ulysses masks its gathered sequence.
"""

from __future__ import annotations

from shardzoo.parallel.sdpa_mode import run_sequence_attention

NAMES = {"ring": "shardzoo_ring", "ulysses": "shardzoo_ulysses"}
_CTX = "_shardzoo_parallel"


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: q [b, h, s, d], k / v [b, h_kv, s, d] (this rank's
    heads and sequence shard) -> ([b, s, h, d], None)."""
    state = module.__dict__.get(_CTX)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs shardzoo's sequence-parallel attention but belongs to no "
                           f"parallelized model; set the model's attention implementation back to 'sdpa'")
    mesh = state.mesh
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    causal = bool(getattr(module, "is_causal", True))
    if window is not None and query.shape[2] * mesh.sp_size > window:
        _check_window(module, state, int(window), causal, dropout)
    out = run_sequence_attention(state, query, key, value, causal=causal, softmax_scale=scaling, dropout_p=dropout,
                                 training=module.training, window=None if window is None else int(window))
    return out.transpose(1, 2).contiguous(), None


def _check_window(module, state, window: int, causal: bool, dropout: float) -> None:
    """The cases of a sliding window shorter than the sequence that are not built under sp."""
    who = f"{type(module).__name__} (sliding window of {window} tokens)"
    if not causal:
        raise ValueError(f"{who}: a sliding window is applied to causal attention only; the module's is_causal is "
                         f"False. Use sp=1 for it")
    if state.cu_seqlens is not None:
        raise ValueError(f"{who}: packed documents with a sliding window are not split under sp; pass unpacked rows, "
                         f"or use sp=1")
    if dropout > 0.0 and module.training:
        raise ValueError(f"{who}: attention dropout (p={dropout}) with a sliding window is not built under sp; set "
                         f"the model's attention_dropout to 0, or use sp=1")


def register() -> None:
    """Register ``shardzoo_ring`` and ``shardzoo_ulysses`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    for name in NAMES.values():
        AttentionInterface.register(name, _attention)


def use_sequence_parallel_attention(model, state) -> None:
    """Switch ``model`` (and every config inside it) to shardzoo's attention for ``state.sp_mode``
    and point its attention modules at ``state``."""
    register()
    name = NAMES[state.sp_mode]
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            _set_impl(config, name)
        if "attention" in type(module).__name__.lower():
            module.__dict__[_CTX] = state


def _set_impl(config, name: str) -> None:
    try:
        config._attn_implementation = name
    except (AttributeError, ValueError):  # versions keep it behind an internal field
        config._attn_implementation_internal = name
