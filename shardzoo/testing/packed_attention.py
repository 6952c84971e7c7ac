"""Packed documents and grouped-query attention against serial SDPA run per document.

Every rank builds the full packed q [B, H, S, d], k / v [B, H_kv, S, d] from a seed, runs the
serial reference document by document (``F.scaled_dot_product_attention`` with the kv heads
repeated, outputs concatenated) in fp32 and in fp64, then shards with ``cu_seqlens``, runs the
parallel attention, gathers and back-propagates. Tolerances follow from the serial fp32 run's
own error against fp64 (:func:`shardzoo.testing.assert_close_conditioned`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardzoo.layers.sequence import gather_sequence, shard_sequence
from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of


def offsets(lengths) -> torch.Tensor:
    """int32 cu_seqlens [docs + 1] of documents of ``lengths``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def packed_inputs(batch, heads, kv_heads, seq, head_dim, seed):
    """q, dout [batch, heads, seq, head_dim]; k, v [batch, kv_heads, seq, head_dim]; and a
    weight for the lse [batch, heads, seq]; fp64, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda h: torch.randn(batch, h, seq, head_dim, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, dout = draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)
    return q, k, v, dout, torch.randn(batch, heads, seq, generator=g, dtype=torch.float64)


def per_document(q, k, v, lengths, causal):
    """Serial attention document by document, kv heads repeated: (out, lse) concatenated."""
    groups = q.shape[1] // k.shape[1]
    outs, lses, start = [], [], 0
    for n in lengths:
        part = slice(start, start + n)
        qd = q[:, :, part]
        kd, vd = (t[:, :, part].repeat_interleave(groups, 1) for t in (k, v))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal))
        scores = (qd @ kd.transpose(-1, -2)) / q.shape[-1] ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        lses.append(scores.logsumexp(-1))
        start += n
    return torch.cat(outs, 2), torch.cat(lses, 2)


def serial_grads(q, k, v, dout, lse_weight, lengths, causal, dtype, with_lse):
    """(out, [lse,] dq, dk, dv) of the per-document reference in ``dtype``; the loss is
    sum(out * dout) (+ sum(lse * lse_weight) with ``with_lse``)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = per_document(*leaves, lengths, causal)
    loss = (out * dout.to(dtype)).sum() + ((lse * lse_weight.to(dtype)).sum() if with_lse else 0)
    loss.backward()
    return (out.detach(),) + ((lse.detach(),) if with_lse else ()) + tuple(t.grad for t in leaves)


def parallel_grads(attention, q, k, v, dout, lse_weight, lengths, causal, group, with_lse, dense=False, **kwargs):
    """Shard with cu_seqlens (``dense``: one document, zigzag shards when causal, no
    cu_seqlens), attend (``kwargs`` passed on), gather: (out, [lse,] dq, dk, dv) in q's dtype."""
    cu = None if dense else offsets(lengths)
    zigzag = dense and causal
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    local = [shard_sequence(t, group, 2, zigzag, cu) for t in leaves]
    result = attention(*local, group=group, causal=causal, cu_seqlens=cu, **kwargs)
    out_local, lse_local = result if with_lse else (result, None)
    out = gather_sequence(out_local, group, 2, zigzag, cu)
    loss = (out * dout).sum()
    lse = None
    if with_lse:
        lse = gather_sequence(lse_local, group, 2, zigzag, cu)
        loss = loss + (lse * lse_weight.to(lse.dtype)).sum()
    loss.backward()
    return (out.detach(),) + ((lse.detach(),) if with_lse else ()) + tuple(t.grad for t in leaves)


def compare_packed(actual, expected, exact, what, names=("out", "dq", "dk", "dv")):
    """Each parallel result against the fp64 one within the one reorder bound, at the serial
    run's own error; a gradient's floor is the root-mean-square of all the gradients (a
    document of one token has dq = 0, the rounding of terms of their size)."""
    grads = [x for name, x in zip(names, exact) if name.startswith("d")]
    for name, a, e, x in zip(names, actual, expected, exact):
        assert a.shape == e.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        floor = rms_of(grads) if name.startswith("d") else 0.0
        assert_close_conditioned(a, e, x, f"{what} {name}", terms=TINY_MODEL_TERMS, floor=floor)


def long_tailed_lengths(total: int, seed: int, median: int = 512, sigma: float = 1.5) -> list[int]:
    """Document lengths of the packed benchmark: log-normal (``median`` tokens, log-space standard
    deviation ``sigma``; about 1 in 10 documents over 3.5k tokens at the defaults), rounded up
    to at least 1, drawn until they fill ``total`` tokens (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = float(torch.exp(torch.randn((), generator=g, dtype=torch.float64) * sigma) * median)
        lengths.append(max(1, min(int(round(draw)), total - sum(lengths))))
    return lengths
