"""The attention block kernel on CPU through torch's fused flash kernel (the ``"aten"`` backend).

``aten._scaled_dot_product_flash_attention_for_cpu`` computes one block tile by tile (no score
matrix) and returns the natural-log lse; its backward takes ``out`` and ``lse`` as arguments,
so a *global* (merged) lse gives the block's exact share of the gradients, as ring attention
needs. This module adapts it to the contract of :mod:`flash_attention_ref` (same signatures):

* half inputs are upcast to fp32 first, so every result is accumulated and returned in fp32
  (the op itself would round per-block gradients to the input dtype);
* the key padding mask becomes an additive -inf mask;
* rows that see no key get ``lse = -inf`` (the op reports 0 there) and contribute nothing
  to the gradients (their lse is passed to the backward as +inf);
* a sliding window (``window``, a :class:`~.flash_attention_ref.Band`) becomes, with the causal
  triangle and the padding, one additive [B, 1, Sq, Sk] mask (the op then runs non-causal):
  a score-sized mask, which ring attention only builds for the blocks the window cuts.
"""
from __future__ import annotations

import torch


def available() -> bool:
    """True when this torch build has the CPU flash attention ops."""
    aten = torch.ops.aten
    return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _additive_mask(key_padding_mask, dtype):
    """bool [B, Sk] (True = attend) -> additive [B, 1, 1, Sk] (0 or -inf), or None."""
    if key_padding_mask is None:
        return None
    mask = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    return mask.masked_fill_(~key_padding_mask, float("-inf"))[:, None, None, :]


def _empty_rows(batch, sq, causal, key_padding_mask, device):
    """Bool [B, 1, Sq], True for query rows without a visible key, or None when there are none.

    Causal is top-left aligned: row i sees keys j <= i, so it is empty iff i is before the
    first visible key of its batch row."""
    if key_padding_mask is None:
        return None
    any_key = key_padding_mask.any(-1)  # [B]
    if not causal:
        return (~any_key)[:, None, None].expand(batch, 1, sq)
    first = torch.where(any_key, key_padding_mask.int().argmax(-1), sq)  # [B]; no key at all: every row
    rows = torch.arange(sq, device=device)
    return (rows[None, :] < first[:, None])[:, None, :]


def _window_visible(sq, sk, causal, key_padding_mask, window, device):
    """Bool [B or 1, 1, Sq, Sk]: the window's band, the causal triangle and the padding."""
    visible = window.visible(0, sq, 0, sk)
    if causal:
        visible = visible & torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    visible = visible[None, None]
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    return visible


def _window_forward(q, k, v, causal, key_padding_mask, softmax_scale, window, ct):
    visible = _window_visible(q.shape[2], k.shape[2], causal, key_padding_mask, window, q.device)
    empty = ~visible.any(-1)  # [B or 1, 1, Sq]
    # a row without a key would be all -inf in the op; let it see every key, then zero it
    additive = torch.zeros(visible.shape, dtype=ct, device=q.device).masked_fill_(~(visible | empty[..., None]),
                                                                                 float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(ct), k.to(ct), v.to(ct), 0.0, False, attn_mask=additive, scale=softmax_scale)
    lse = lse.masked_fill(empty, float("-inf"))
    return out.masked_fill(empty[..., None], 0.0).to(q.dtype), lse.to(ct)


def attention_forward_aten(q, k, v, causal, key_padding_mask, softmax_scale, window=None):
    """q [B, H, Sq, D], k/v [B, H, Sk, D] -> (out [B, H, Sq, D] q.dtype, lse [B, H, Sq] fp32/fp64)."""
    ct = _compute_dtype(q.dtype)
    if window is not None:
        return _window_forward(q, k, v, causal, key_padding_mask, softmax_scale, window, ct)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(ct), k.to(ct), v.to(ct), 0.0, causal, attn_mask=_additive_mask(key_padding_mask, ct),
        scale=softmax_scale)
    empty = _empty_rows(q.shape[0], q.shape[2], causal, key_padding_mask, q.device)
    if empty is not None:
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out.to(q.dtype), lse.to(ct)


def attention_backward_aten(dout, q, k, v, out, lse, causal, key_padding_mask, softmax_scale, window=None):
    """Backward with a possibly global ``lse``; returns (dq, dk, dv) in fp32 (fp64 for fp64)."""
    ct = _compute_dtype(q.dtype)
    lse = lse.to(ct)
    # a row that saw no key anywhere: exp(s - (+inf)) = 0, so it adds nothing
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    mask = _additive_mask(key_padding_mask, ct)
    if window is not None:  # rows without a key in this block: exp(-inf - lse) = 0 adds nothing
        visible = _window_visible(q.shape[2], k.shape[2], causal, key_padding_mask, window, q.device)
        mask = torch.zeros(visible.shape, dtype=ct, device=q.device).masked_fill_(~visible, float("-inf"))
        causal = False  # the triangle is in the mask
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(ct), q.to(ct), k.to(ct), v.to(ct), out.to(ct), lse, 0.0, causal, attn_mask=mask, scale=softmax_scale)
