"""Sequence-parallel attention against serial SDPA on the full sequence: full inputs and padding
masks from a seed, the fp64 reference output and gradients, the shard -> attend -> gather round
trip, and the tolerances. For the ring and Ulysses attention tests."""

import torch
import torch.nn.functional as F

from shardzoo.layers.sequence import gather_sequence, shard_padding_mask, shard_sequence
from shardzoo.testing import assert_close, assert_close_conditioned
from shardzoo.testing.dtypes import SEQUENCE_BF16_TOL, TINY_MODEL_TERMS, dtypes, rms_of

DTYPES = dtypes("fp32", "fp64", "bf16")
MASK_KINDS = ["none", "random", "right_pad", "rank_padded", "all_padded"]


def sdpa_reference(q, k, v, mask, causal, scale=None, window=None):
    """Serial attention with an explicit bool mask; rows that see no key give 0, as the kernel.
    ``window``: a sliding window, query i sees the keys j > i - window (transformers' convention)."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    visible = torch.ones(q.shape[0], 1, seq_q, seq_k, dtype=torch.bool)
    if causal:
        visible &= torch.ones(seq_q, seq_k, dtype=torch.bool).tril()
    if window is not None:
        visible &= torch.arange(seq_k)[None, :] > torch.arange(seq_q)[:, None] - window
    if mask is not None:
        visible &= mask[:, None, None, :]
    has_key = visible.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | ~has_key, scale=scale)
    return out * has_key


def make_mask(kind, batch, seq, world, zigzag, seed):
    """A [batch, seq] bool padding mask (True = attend) of the given kind, or None."""
    g = torch.Generator().manual_seed(seed + 99)
    if kind == "none":
        return None
    mask = torch.ones(batch, seq, dtype=torch.bool)
    if kind == "random":
        mask = torch.rand(batch, seq, generator=g) > 0.3
    elif kind == "right_pad":
        for b in range(batch):
            mask[b, int(torch.randint(1, seq + 1, (1,), generator=g)) :] = False
    elif kind == "rank_padded":  # every key held by one rank is padding
        padded_rank = seed % world
        chunks = [padded_rank, 2 * world - 1 - padded_rank] if zigzag else [padded_rank]
        pieces = 2 * world if zigzag else world
        for c in chunks:
            mask[:, c * seq // pieces : (c + 1) * seq // pieces] = False
    elif kind == "all_padded":  # batch element 0 sees no key at all
        mask[0] = False
    return mask


def full_inputs(batch, heads, seq, head_dim, dtype, seed):
    """q, k, v, dout [batch, heads, seq, head_dim] in ``dtype``, drawn in fp64 from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.float64).to(dtype) for _ in range(4))
    return q, k, v, dout


class Reference(tuple):
    """(out, dq, dk, dv) in fp64, and ``serial``: the same serial attention in the inputs' own
    dtype (None for bf16), whose distance to fp64 is the rounding a parallel run may show too."""

    serial = None


def _sdpa_grads(q, k, v, dout, mask, causal, dtype, window=None):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out = sdpa_reference(*leaves, mask, causal, window=window)
    out.backward(dout.to(dtype))
    return (out.detach(), *(t.grad for t in leaves))


def reference_grads(q, k, v, dout, mask, causal, window=None):
    """fp64 reference output and (dq, dk, dv) for the (possibly rounded) inputs, with the serial
    run in the inputs' dtype as ``.serial`` (:class:`Reference`); ``window`` as sdpa_reference."""
    ref = Reference(_sdpa_grads(q, k, v, dout, mask, causal, torch.float64, window))
    if q.dtype != torch.bfloat16:
        ref.serial = _sdpa_grads(q, k, v, dout, mask, causal, q.dtype, window)
    return ref


def parallel_attention(attention, q, k, v, dout, mask, causal, group, shard_zigzag=None, **kwargs):
    """Shard full inputs (zigzag when causal unless ``shard_zigzag`` says otherwise), run
    ``attention`` on the shards, gather; returns out, dq, dk, dv."""
    zigzag = causal if shard_zigzag is None else shard_zigzag
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    local = [shard_sequence(t, group, dim=2, zigzag=zigzag) for t in leaves]
    local_mask = None if mask is None else shard_padding_mask(mask, group, zigzag=zigzag)
    out_local = attention(*local, group=group, causal=causal, key_padding_mask=local_mask, **kwargs)
    out = gather_sequence(out_local, group, dim=2, zigzag=zigzag)
    out.backward(dout)
    return out.detach(), leaves[0].grad, leaves[1].grad, leaves[2].grad


def compare(actual, expected, dtype, what):
    """Assert (out, dq, dk, dv) of a parallel run equal the fp64 reference: dtype kept; bf16 at
    SEQUENCE_BF16_TOL, other dtypes within the one reorder bound (testing/dtypes.py), measured
    against the serial run's own error where ``expected`` carries it (:func:`reference_grads`).
    A gradient that cancels to nothing (dq of a query that sees one key) is the rounding of
    terms of the size of all three gradients: their root-mean-square is its floor."""
    names = ("out", "dq", "dk", "dv")
    serial = getattr(expected, "serial", None)
    grad_floor = rms_of(expected[1:])
    for i, (name, a, e) in enumerate(zip(names, actual, expected)):
        assert a.dtype == dtype, f"{what} {name} dtype {a.dtype} != {dtype}"
        tol = dict(terms=TINY_MODEL_TERMS, floor=0.0 if name == "out" else grad_floor)
        if serial is not None and dtype != torch.bfloat16:
            assert_close_conditioned(a, serial[i], e, f"{what} {name}", **tol)
        elif dtype == torch.bfloat16:
            rtol, atol = SEQUENCE_BF16_TOL["out" if name == "out" else "grad"]
            torch.testing.assert_close(a.double(), e, rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")
        else:
            assert_close(a, e.to(dtype), f"{what} {name}", **tol)


# dropout probability and seed of the dropout cases (a seed above 2**32)
DROP_P, DROP_SEED = 0.25, 2**35 + 7


def single_rank_dropout(q, k, v, dout, mask, causal, heads=slice(None)):
    """Single-rank flash_attention with dropout on the full sequence (all heads), then ``heads``:
    out, dq, dk, dv."""
    from shardzoo.kernels import flash_attention

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, key_padding_mask=mask, dropout_p=DROP_P, dropout_seed=DROP_SEED)
    out.backward(dout)
    return tuple(t[:, heads] for t in (out.detach(), *(x.grad for x in leaves)))
