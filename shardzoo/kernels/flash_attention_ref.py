"""Pure-torch reference of the attention block kernel (same signatures as the Triton launchers).

Never materialises a full Sq x Sk score matrix: queries are processed in chunks of
``QUERY_CHUNK`` rows and keys in chunks of ``KEY_CHUNK`` with an online softmax, so the
largest temporary is [B, H, QUERY_CHUNK, KEY_CHUNK]. Computes in fp32 (fp64 for fp64 input).

``dropout`` (a :class:`~shardzoo.kernels.dropout_mask.DropoutKeys`, or None) drops attention
probabilities with the stateless mask of ``dropout_mask``, drawn per chunk: lse stays the
undropped normaliser, ``out = (P * Z / (1-p)) V``.

``window`` (a :class:`Band`, or None) is a sliding window over global positions: query row i
sees key column j only where ``k_positions[j] > q_positions[i] - size``, built per chunk.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .dropout_mask import keep_mask


class Band(NamedTuple):
    """A sliding window of ``size`` tokens: query at global position p sees the keys at
    positions > p - size. q_positions int64 [Sq], k_positions int64 [Sk]."""

    size: int
    q_positions: torch.Tensor
    k_positions: torch.Tensor

    def visible(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Bool [q1-q0, k1-k0]: which keys of the chunk lie inside each row's window."""
        return self.k_positions[None, k0:k1] > self.q_positions[q0:q1, None] - self.size

KEY_CHUNK = 256
QUERY_CHUNK = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _visible(q0, q1, k0, k1, causal, key_padding_mask, device, window=None):
    """Bool mask broadcastable to [B, H, q1-q0, k1-k0], or None when every key is visible."""
    visible = None
    if key_padding_mask is not None:
        visible = key_padding_mask[:, None, None, k0:k1]
    if window is not None:
        band = window.visible(q0, q1, k0, k1)
        visible = band if visible is None else visible & band
    if causal:
        rows = torch.arange(q0, q1, device=device)[:, None]
        cols = torch.arange(k0, k1, device=device)[None, :]
        tri = cols <= rows
        visible = tri if visible is None else visible & tri
    return visible


def _key_end(q1: int, sk: int, causal: bool) -> int:
    # causal: query i sees keys j <= i, so a query chunk ending at q1 needs keys < q1
    return min(sk, q1) if causal else sk


def _keep(dropout, q0, q1, k0, k1):
    """Bool [B, H, q1-q0, k1-k0] keep-mask of one chunk."""
    return keep_mask(dropout.row_keys[:, :, q0:q1, None], dropout.col_keys[k0:k1], dropout.threshold)


def attention_forward_torch(q, k, v, causal, key_padding_mask, softmax_scale, dropout=None, window=None):
    """Reference forward. q [B, H, Sq, D], k/v [B, H, Sk, D] -> (out [B, H, Sq, D] q.dtype, lse [B, H, Sq] fp32)."""
    ct = _compute_dtype(q.dtype)
    batch, heads, sq, dim = q.shape
    sk = k.shape[2]
    out = torch.empty(batch, heads, sq, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, sq, dtype=ct, device=q.device)
    neg_inf = float("-inf")
    for q0 in range(0, sq, QUERY_CHUNK):
        q1 = min(sq, q0 + QUERY_CHUNK)
        qc = q[:, :, q0:q1].to(ct) * softmax_scale
        row_max = torch.full((batch, heads, q1 - q0), neg_inf, dtype=ct, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(batch, heads, q1 - q0, dim, dtype=ct, device=q.device)
        for k0 in range(0, _key_end(q1, sk, causal), KEY_CHUNK):
            k1 = min(_key_end(q1, sk, causal), k0 + KEY_CHUNK)
            scores = qc @ k[:, :, k0:k1].to(ct).transpose(-1, -2)
            visible = _visible(q0, q1, k0, k1, causal, key_padding_mask, q.device, window)
            if visible is not None:
                scores = scores.masked_fill(~visible, neg_inf)
            new_max = torch.maximum(row_max, scores.amax(-1))
            # a row with no visible key so far keeps max -inf; shift by 0 to avoid inf - inf
            shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
            probs = torch.exp(scores - shift[..., None])
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + probs.sum(-1)  # the undropped normaliser
            if dropout is not None:
                probs = probs * _keep(dropout, q0, q1, k0, k1)
            acc = acc * alpha[..., None] + probs @ v[:, :, k0:k1].to(ct)
            row_max = new_max
        empty = row_sum == 0
        safe_sum = torch.where(empty, torch.ones_like(row_sum), row_sum)
        drop_scale = 1.0 if dropout is None else dropout.scale
        out[:, :, q0:q1] = (acc * (drop_scale / safe_sum[..., None])).to(q.dtype)
        lse[:, :, q0:q1] = torch.where(empty, torch.full_like(row_sum, neg_inf), row_max + torch.log(safe_sum))
    return out, lse


def attention_backward_torch(dout, q, k, v, out, lse, causal, key_padding_mask, softmax_scale, dropout=None,
                             lse_grad=None, window=None):
    """Reference backward with a possibly global ``lse``: P = exp(scale*S - lse).

    With dropout (mask Z, out the dropped output): dV = (P Z / (1-p))^T dO,
    dP = (dO V^T) Z / (1-p), dS = P (dP - rowsum(dO * out)).

    ``lse_grad`` [B, H, Sq] (optional): the gradient reaching lse, which adds P * lse_grad to
    dS, i.e. D becomes rowsum(dO * out) - lse_grad.

    Returns (dq [B, H, Sq, D], dk, dv [B, H, Sk, D]) in fp32 (fp64 for fp64 input).
    """
    ct = _compute_dtype(q.dtype)
    sq, sk = q.shape[2], k.shape[2]
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    delta = (dout.to(ct) * out.to(ct)).sum(-1)  # D_i = rowsum(dO * O), [B, H, Sq]
    if lse_grad is not None:
        delta = delta - lse_grad.to(ct)
    # rows with lse = -inf saw no key: exp(s - (+inf)) = 0 makes them contribute nothing
    lse = lse.to(ct)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    for q0 in range(0, sq, QUERY_CHUNK):
        q1 = min(sq, q0 + QUERY_CHUNK)
        qc = q[:, :, q0:q1].to(ct)
        doc = dout[:, :, q0:q1].to(ct)
        lse_c = lse[:, :, q0:q1, None]
        delta_c = delta[:, :, q0:q1, None]
        dq_c = torch.zeros_like(qc)
        for k0 in range(0, _key_end(q1, sk, causal), KEY_CHUNK):
            k1 = min(_key_end(q1, sk, causal), k0 + KEY_CHUNK)
            kc = k[:, :, k0:k1].to(ct)
            vc = v[:, :, k0:k1].to(ct)
            scores = (qc * softmax_scale) @ kc.transpose(-1, -2)
            visible = _visible(q0, q1, k0, k1, causal, key_padding_mask, q.device, window)
            if visible is not None:
                scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.exp(scores - lse_c)
            dprobs = doc @ vc.transpose(-1, -2)
            if dropout is None:
                dv[:, :, k0:k1] += probs.transpose(-1, -2) @ doc
            else:
                kept = _keep(dropout, q0, q1, k0, k1).to(ct) * dropout.scale  # Z / (1-p)
                dv[:, :, k0:k1] += (probs * kept).transpose(-1, -2) @ doc
                dprobs = dprobs * kept
            dscores = probs * (dprobs - delta_c)
            dq_c += dscores @ kc
            dk[:, :, k0:k1] += dscores.transpose(-1, -2) @ qc
        dq[:, :, q0:q1] = dq_c * softmax_scale
    dk *= softmax_scale
    return dq, dk, dv
