"""Megatron sequence parallelism between a model's 1D blocks: the shared state of one model.

Between the tp blocks (norms, dropout, residual adds) each tp rank holds its chunk of the
sequence, ``[b, s_pad/p, H]`` with ``s_pad`` the rank's sequence length (after sp) rounded up
to a multiple of p; the padding rows are zeros, and nothing reads them: every way out of the
layout drops them first.

* :meth:`SequenceShards.split` enters the layout: the full ``[b, s, H]`` -> this rank's chunk
  (no communication forward; backward all-gathers the gradient).
* :meth:`SequenceShards.gather` is what the column layers of a block read: one all-gather of
  the chunks, ``[b, s_pad/p, H] -> [b, s, H]``, shared by every column layer reading the same
  tensor (q, k and v; gate and up), so backward sums their input gradients on this rank and
  reduce-scatters them once, as Megatron's fused QKV does. The engine gathers at the input of
  the module holding the column layers (an attention, an MLP: torchtitan's
  ``PrepareModuleInput``), whose code then reads the whole sequence's shape.
* :meth:`SequenceShards.scatter` is a row layer's sum: the partial ``[b, s, H]`` of every rank
  reduce-scattered to this rank's chunk (backward all-gathers).
* :meth:`SequenceShards.join` leaves the layout: all-gather and drop the padding.
* :meth:`SequenceShards.dropout` draws the mask of the whole ``[b, s, H]`` from the default
  stream (the same on every tp rank, and what the serial model draws) and keeps this rank's
  chunk, so dropout on the chunk equals dropout on the replicated activation. A dropout module
  inside a block may also see tensors of the whole sequence (attention probabilities);
  :meth:`SequenceShards.holds_chunk` tells the two apart by the sequence dim's length.

``length`` is the current forward's sequence length; :meth:`split` sets it, and activation
checkpointing puts back the value of the forward it recomputes.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from shardzoo.comm import collectives as comm
from shardzoo.layers.common_1d import SEQ_DIM
from shardzoo.layers.partial_grads import PartialGrads


class SequenceShards:
    """The sequence-sharded layout between one model's 1D blocks (module doc) on ``mesh``'s tp axis."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.length: int | None = None  # this forward's sequence length on this rank (after sp)
        self._read: tuple | None = None  # (weakref to the chunk, its gathered tensor, grad mode)
        self.partial_grads = PartialGrads(mesh)  # norms' and row biases' gradients, summed once per block

    @property
    def parts(self) -> int:
        return self.mesh.tp_size

    def padded(self, length: int) -> int:
        """``length`` rounded up to a multiple of tp."""
        return -(-length // self.parts) * self.parts

    def split(self, x_full: torch.Tensor) -> torch.Tensor:
        """[b, s, H] (the same on every tp rank) -> this rank's chunk [b, s_pad/p, H]."""
        _require_3d("entering the sequence-sharded layout", x_full)
        self.length = x_full.shape[SEQ_DIM]
        return comm.scatter_to(self._pad(x_full), self.mesh.tp_group, SEQ_DIM)

    def join(self, x_local: torch.Tensor) -> torch.Tensor:
        """This rank's chunk [b, s_pad/p, H] -> [b, s, H] on every tp rank (contiguous: a
        pipeline stage sends it as it is)."""
        return comm.gather_from(x_local, self.mesh.tp_group, SEQ_DIM)[:, :self._length()].contiguous()

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """A column layer's input: [b, s_pad/p, H] -> [b, s, H], one all-gather per tensor read."""
        _require_3d("a column layer under sequence parallelism", x_local)
        grad = torch.is_grad_enabled()
        if self._read is not None and self._read[0]() is x_local and self._read[2] == grad:
            return self._read[1]
        # contiguous: the gather lands sequence-major, and F.linear would copy a strided input
        # once per reader (q, k and v each keeping its own copy for backward)
        full = comm.all_gather(x_local, self.mesh.tp_group, SEQ_DIM)[:, :self._length()].contiguous()
        self._read = (weakref.ref(x_local), full, grad)
        return full

    def scatter(self, y_partial: torch.Tensor) -> torch.Tensor:
        """A row layer's partial output [b, s, H] -> the sum's chunk [b, s_pad/p, H]."""
        self._read = None  # the pair is done: keep no gathered input alive past it
        return comm.reduce_scatter(self._pad(y_partial), self.mesh.tp_group, SEQ_DIM)

    def is_gathered(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the output of the latest :meth:`gather`."""
        return self._read is not None and self._read[1] is x

    def holds_chunk(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is this rank's chunk of the current sequence ([b, s_pad/p, H]), not a
        tensor of the whole sequence (attention probabilities, a column layer's output)."""
        if self.length is None or x.dim() != 3:
            return False
        return x.shape[SEQ_DIM] == self.padded(self.length) // self.parts != self.length or self.length == 1

    def dropout(self, x_local: torch.Tensor, p: float) -> torch.Tensor:
        """F.dropout of the chunk with this rank's chunk of the whole activation's mask."""
        length = self._length()
        shape = (x_local.shape[0], length, *x_local.shape[2:])
        keep = F.dropout(torch.ones(shape, dtype=x_local.dtype, device=x_local.device), p, training=True)
        rows = x_local.shape[SEQ_DIM]
        start = self.mesh.tp_rank * rows
        # a copy of this rank's rows: the product keeps its mask for backward, and a view would
        # keep the whole sequence's
        return x_local * self._pad(keep)[:, start:start + rows].clone()

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.padded(x.shape[SEQ_DIM]) - x.shape[SEQ_DIM]
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, extra)) if extra else x

    def _length(self) -> int:
        if self.length is None:
            raise RuntimeError("the sequence-sharded layout was not entered (SequenceShards.split) before a block "
                               "read it; call the model, or run its blocks in order from the first")
        return self.length

    def __repr__(self) -> str:
        return f"SequenceShards(tp={self.parts}, length={self.length})"


def _require_3d(what: str, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"{what} takes [batch, seq, hidden] activations; got shape {tuple(x.shape)}. Reshape to "
                         f"3 dims, or turn Megatron sequence parallelism off (sequence_parallel=False)")
