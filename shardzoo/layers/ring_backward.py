"""Ring attention backward: recompute each block from the saved global output and lse.

The block kernel's backward with the *global* lse gives a block's exact share of the gradients.
dQ accumulates locally; dK / dV of a block travel round the ring with it and arrive home after P
hops. Two schedules (``RingSettings.grad_tiles``), the same gradients and the same bytes:

* 0 (CUDA, :func:`_backward_overlapped`): K / V travel whole, as in forward; each visible block
  is one kernel call, then the dK / dV pair arriving with the block's partial gradient is waited
  for, added to and sent on, so every hop overlaps a block's compute. Holds two K / V blocks
  (P > 2), two dK / dV pairs and a block of kernel output.
* n > 0 (CPU, :func:`_backward_chunked`): the keys are cut into n chunks and each chunk goes
  round the whole ring on its own: its K / V and dK / dV are swapped in place with the previous
  rank's before each step, and the step's visible part of the chunk runs as row tiles added in
  place. A rank holds one chunk of K / V and of dK / dV (1/n of a block each) on top of q, k, v,
  out, dout and the gradients it returns: memory at the floor. The hops are not overlapped:
  over gloo they cost milliseconds against seconds of block compute on CPU.

The bytes are the same because every chunk takes the same P-1 K / V hops and P dK / dV hops
the whole block would.
"""

from __future__ import annotations

import torch

from shardzoo.comm import RingExchange
from shardzoo.comm.ops import group_rank
from shardzoo.kernels import attention_block_backward
from shardzoo.layers.ring_core import (RingSettings, accumulation_dtype, chunks_round_ring, expand_kv, fold_kv_grad,
                                       pad_to, ring_blocks)


def ring_backward(dout, q, k, v, out, lse, dlse, key_padding_mask, settings: RingSettings):
    """Backward pass without autograd. ``dlse`` [B, H, S] is the gradient reaching the returned
    lse (None when it was not used).

    Returns (dq in the accumulation dtype (fp32, fp64 for fp64), dk, dv), shapes of q, k, v."""
    backward = _backward_chunked if settings.grad_tiles else _backward_overlapped
    return backward(dout, q, k, v, out, lse, dlse, key_padding_mask, settings)


def _piece_backward(dout, q, k_block, v_block, out, lse, dlse, mask, piece, settings, me, source, col0=0,
                    banded=False):
    """(dq, dk, dv) of one kernel call: rows r0:r1 here against key columns c0:c1 of ``source``,
    found at ``c0 - col0`` in the block in hand; dk / dv folded back to the kv heads."""
    r0, r1, c0, c1, causal = piece
    groups = q.shape[1] // k_block.shape[1]
    cols = slice(c0 - col0, c1 - col0)
    dq, dk, dv = attention_block_backward(
        dout[:, :, r0:r1], q[:, :, r0:r1], expand_kv(k_block[:, :, cols], groups),
        expand_kv(v_block[:, :, cols], groups), out[:, :, r0:r1], lse[:, :, r0:r1], causal=causal,
        key_padding_mask=mask[0][:, cols] if mask else None, lse_grad=None if dlse is None else dlse[:, :, r0:r1],
        **settings.block_kwargs(q.shape[2], me, source, piece, q.device, banded),
    )  # fmt: skip
    return dq, fold_kv_grad(dk, groups), fold_kv_grad(dv, groups)


def _travelling(k, v, key_padding_mask, length):
    block = pad_to([k, v], length, 2)
    return block if key_padding_mask is None else block + pad_to([key_padding_mask], length, 1)


def _backward_overlapped(dout, q, k, v, out, lse, dlse, key_padding_mask, settings: RingSettings):
    acc = accumulation_dtype(q.dtype)
    grad_ring = RingExchange(settings.group)
    me, plan = group_rank(settings.group), settings.plan(q.shape[2])
    width = plan.max_len
    kv_shape = (k.shape[0], k.shape[1], width, k.shape[3])
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    pending = None  # the hop of the [dK, dV] pair in flight
    for step, source, block in ring_blocks(settings.group, _travelling(k, v, key_padding_mask, width)):
        k_block, v_block, *mask = block
        if step == 0:  # own block: its dK / dV start their trip here
            grads = [torch.zeros(kv_shape, dtype=acc, device=k.device) for _ in range(2)]
        else:  # the block's gradient so far arrives with it, one step behind the K / V
            grads = pending.wait()
        for rect, banded in settings.pieces(me, source, q.shape[2], None):
            dq_b, dk_b, dv_b = _piece_backward(dout, q, k_block, v_block, out, lse, dlse, mask, rect, settings, me,
                                               source, banded=banded)
            r0, r1, c0, c1, _ = rect
            dq[:, :, r0:r1] += dq_b
            grads[0][:, :, c0:c1] += dk_b
            grads[1][:, :, c0:c1] += dv_b
            del dq_b, dk_b, dv_b  # free before the next kernel call
        pending = grad_ring.start(grads)
    dk, dv = pending.wait()  # the P-th hop brings our own block's gradient home
    return dq, dk[:, :, : k.shape[2]], dv[:, :, : v.shape[2]]


def _backward_chunked(dout, q, k, v, out, lse, dlse, key_padding_mask, settings: RingSettings):
    acc = accumulation_dtype(q.dtype)
    me, plan = group_rank(settings.group), settings.plan(q.shape[2])
    own, width = k.shape[2], plan.max_len
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # written chunk by chunk as each comes home
    row_tile = settings.tile(q.shape[2])

    def zero_grads(c0, c1):
        shape = (k.shape[0], k.shape[1], c1 - c0, k.shape[3])
        return [torch.zeros(shape, dtype=acc, device=k.device) for _ in range(2)]

    for c0, c1, source, block, grads in chunks_round_ring(settings.group, k, v, key_padding_mask, width,
                                                          settings.tile(width), zero_grads):
        if source is None:  # our own chunk's dK / dV are home
            if c0 < own:
                end = min(c1, own)
                dk[:, :, c0:end], dv[:, :, c0:end] = grads[0][:, :, : end - c0], grads[1][:, :, : end - c0]
            continue
        k_block, v_block, *mask = block
        for piece, banded in settings.pieces(me, source, q.shape[2], row_tile, (c0, c1)):
            dq_t, dk_t, dv_t = _piece_backward(dout, q, k_block, v_block, out, lse, dlse, mask, piece, settings,
                                               me, source, col0=c0, banded=banded)
            r0, r1, a, b, _ = piece
            dq[:, :, r0:r1] += dq_t
            grads[0][:, :, a - c0 : b - c0] += dk_t
            grads[1][:, :, a - c0 : b - c0] += dv_t
            del dq_t, dk_t, dv_t  # free before the next tile's kernel call
        del block, k_block, v_block, mask, grads
    return dq, dk, dv
