"""Sequence parallelism for a module of one's own: its ``F.scaled_dot_product_attention`` calls
routed to shardzoo's ring or Ulysses attention by a ``TorchFunctionMode``.

``torch.overrides.TorchFunctionMode`` is torch's own extension point for intercepting torch
functions (torch's ``context_parallel`` works the same way); the model's code is not touched.
A forward pre-hook enters the mode and a forward hook registered with ``always_call=True``
leaves it, so an exception inside the forward does not leave it entered. The hooks sit on the
model's attention modules (the modules whose planned projections carry heads, heads.py), or on
the whole model where it has none: a mode sees every torch call made while it is entered, at a
Python round trip each, so it is entered only where SDPA is called. While it is active,
every SDPA call ``(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)`` on this rank's
heads and sequence shard, q [b, h, s/P, d], k / v [b, h_kv, s/P, d], becomes
``sequence_attention`` over the mesh's sp axis:

* ``is_causal`` -> causal (the input hook shards zigzag when the model was parallelized causal;
  a causal call on contiguous shards is refused);
* the padding mask the input hook split for this rank -> key_padding_mask; an ``attn_mask``
  tensor is refused (the model takes the padding through ``attention_mask=`` of its forward);
* ``scale`` -> softmax_scale; ``dropout_p`` > 0 -> dropout (SDPA drops whenever p > 0).

A forward of a hooked module under sp that intercepts no SDPA call raises after it: its
attention ran on the local shard alone. The ring's autograd Function runs its own backward, so
the mode is needed in forward only; an activation-checkpoint recompute must run inside it
(``torch.utils.checkpoint(..., context_fn=lambda: (nullcontext(), sdpa_mode_of(model)))``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from shardzoo.layers.attention_core import sequence_attention
from shardzoo.layers.shard_spec import unwrap_ddp
from shardzoo.layers.tensor_layout import layout_of

_MODE = "_shardzoo_sdpa_mode"


def run_sequence_attention(state, q, k, v, *, causal: bool, softmax_scale=None, dropout_p: float = 0.0,
                           training: bool = False, window: int | None = None) -> torch.Tensor:
    """q [b, h, s/P, d], k / v [b, h_kv, s/P, d] of this rank's heads and sequence shard ->
    [b, h, s/P, d], attention over the whole sequence of ``state`` (inputs.Parallelized);
    ``window``: a causal sliding window (sequence_attention)."""
    mesh = state.mesh
    if state.sp_mode == "ulysses" and not _ulysses_fits(k.shape[1], mesh.sp_size):
        rep = q.shape[1] // k.shape[1]  # Ulysses splits kv heads over sp, or copies them
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    batch_offset, head_offset = layout_of(mesh).block_offsets(state.mask_placement, q.shape[0], q.shape[1])
    zigzag = None if state.cu_seqlens is not None else state.zigzag
    return sequence_attention(q, k, v, mesh=mesh, causal=causal, key_padding_mask=state.key_padding_mask,
                              softmax_scale=softmax_scale, sp_mode=state.sp_mode, dropout_p=dropout_p,
                              training=training, head_offset=head_offset, batch_offset=batch_offset,
                              cu_seqlens=state.cu_seqlens, zigzag=zigzag, window=window)


def _ulysses_fits(kv_heads: int, sp: int) -> bool:
    return kv_heads % sp == 0 or sp % kv_heads == 0


class SequenceParallelSDPA(TorchFunctionMode):
    """The mode of one parallelized model (module doc). Entered and left by its forward hooks;
    also a context manager of its own (``with mode:``) for a recompute outside the forward.
    Re-entrant: only the outermost enter pushes it, only the outermost leave pops it."""

    def __init__(self, state, owner: str):
        super().__init__()
        self.state, self.owner = state, owner
        self.depth = 0
        self.calls = 0  # SDPA calls intercepted in the current outermost forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self._attention(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale=None, enable_gqa: bool = False):
        state, who = self.state, f"{self.owner} under sp={self.state.mesh.sp_size}"
        if attn_mask is not None:
            raise ValueError(f"{who}: scaled_dot_product_attention got an attn_mask, which shardzoo's sequence-"
                             f"parallel attention cannot split (its keys live on other ranks). Pass the [B, S] "
                             f"padding mask as attention_mask= of the parallelized model's forward (the model then "
                             f"gets attention_mask=None and must call SDPA with attn_mask=None), or use sp=1")
        if query.dim() != 4 or key.dim() != 4 or query.shape[2] != key.shape[2]:
            raise ValueError(f"{who}: scaled_dot_product_attention got q {tuple(query.shape)}, k "
                             f"{tuple(key.shape)}; sequence parallelism takes self-attention over the model's "
                             f"sequence, q / k / v [batch, heads, seq, head_dim] of equal seq; use sp=1")
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(f"{who}: q has {query.shape[1]} heads and k {key.shape[1]}; pass enable_gqa=True "
                             f"to scaled_dot_product_attention for grouped-query attention")
        if is_causal and state.mesh.sp_size > 1 and not state.zigzag:
            raise ValueError(f"{who}: a causal scaled_dot_product_attention call, but the model was parallelized "
                             f"as not causal (contiguous sequence shards); pass parallelize(..., causal=True)")
        return run_sequence_attention(state, query, key, value, causal=bool(is_causal), softmax_scale=scale,
                                      dropout_p=float(dropout_p), training=dropout_p > 0.0)

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:
            self.calls = 0
            super().__enter__()
        return self

    def __exit__(self, exc_type=None, exc_val=None, exc_tb=None):
        if self.depth == 0:  # an earlier hook failed before the pre-hook entered
            return
        self.depth -= 1
        if self.depth == 0:
            if _get_current_function_mode() is not self:
                raise RuntimeError(f"{self.owner}: another torch function mode was left entered inside its forward; "
                                   f"leave every mode a forward enters")
            super().__exit__(exc_type, exc_val, exc_tb)


def _enter(mode: SequenceParallelSDPA) -> None:
    mode.__enter__()


def _leave(mode: SequenceParallelSDPA, output, where: str) -> None:
    outermost = mode.depth == 1
    mode.__exit__()
    # ``output`` is None when the forward raised (torch calls always_call hooks then too)
    if outermost and output is not None and mode.calls == 0 and mode.state.mesh.sp_size > 1:
        raise RuntimeError(f"{where} ran a forward under sequence parallelism (sp={mode.state.mesh.sp_size}) "
                           f"without calling torch.nn.functional.scaled_dot_product_attention, so its attention saw "
                           f"this rank's sequence shard only. Call F.scaled_dot_product_attention in the attention "
                           f"module's forward (shardzoo routes it over sp), or parallelize with sp=1")


def install(model: nn.Module, state, attention: dict | None = None) -> SequenceParallelSDPA:
    """Route ``model``'s SDPA calls over sp: the mode is entered during the forward of each
    attention module of ``attention`` ({name: heads.AttentionHeads}, from ``split_modules``), or of
    the whole model where that is empty (module doc)."""
    owner = type(model).__name__
    mode = SequenceParallelSDPA(state, owner)
    model.__dict__[_MODE] = mode
    scopes = {f"{owner}'s {name} ({type(a.module).__name__})": a.module for name, a in (attention or {}).items()}
    for where, module in (scopes or {owner: model}).items():
        module.register_forward_pre_hook(lambda m, a: _enter(mode))
        module.register_forward_hook(lambda m, a, y, where=where: _leave(mode, y, where), always_call=True)
    return mode


def sdpa_mode_of(model: nn.Module):
    """The :class:`SequenceParallelSDPA` of a parallelized module of one's own under sp, usable as
    a context manager (an activation-checkpoint recompute runs outside the forward); a no-op
    context where there is none (sp = 1, transformers models)."""
    mode = unwrap_ddp(model).__dict__.get(_MODE)
    return mode if mode is not None else contextlib.nullcontext()
