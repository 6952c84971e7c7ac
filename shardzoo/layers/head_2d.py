"""Classifier and LM heads on the 2D layout (and the bases of the 2.5D / 3D ones).

* ``GridClassifier`` (few classes, e.g. ViT): logits = x W^T + b with W [C, H] split along the
  hidden dim like an embedding table (gathered over ``param_axes``), partial products summed
  over the hidden group (``reduce_from``: every rank of that group goes on with the same
  logits). Output [B/parts, ..., C], batch split as the input, replicated over hidden_axis.
  ``tie_to=`` an embedding of the same placement shares its table as W: a ``GridEmbedding``'s
  is placed exactly as W; a ``GridVocabParallelEmbedding``'s is gathered over the vocabulary
  axes in forward (``vocab_table``, padding rows dropped). The bias stays the classifier's.
* ``LMHead2D`` (vocabulary-parallel logits for the parallel loss): the weight E [V, H] sits as
  in ``VocabParallelEmbedding2D`` (vocab block i, hidden block j on rank (i, j)), so
  ``tie_to=embedding`` shares its Parameter; logits = SUMMA x E^T (summa_2d.SummaLinearT):
  [B/q, ..., V_pad/q], vocabulary block j on rank (i, j). ``loss`` is the vocab-parallel cross
  entropy (layers/cross_entropy.py) over tp_col, averaged over the batch axes.
"""

from __future__ import annotations

import torch
from torch import nn

from shardzoo import comm
from shardzoo.comm import ops
from shardzoo.layers import placements
from shardzoo.layers.cross_entropy import vocab_parallel_cross_entropy
from shardzoo.layers.embedding_2d import (GridEmbedding, GridVocabParallelEmbedding, vocab_parallel_param,
                                          vocab_table)
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec, shard_param, tie_param
from shardzoo.layers.summa_2d import Grid2D, summa_linear_t


def grid_cross_entropy(logits, target, *, mesh, placement: ActivationPlacement, vocab_start: int, vocab_size: int,
                       ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"):
    """Cross entropy of logits [B/parts, ..., V_local] whose batch is split over
    ``placement.batch_axes`` and vocabulary over ``placement.hidden_axis``; target [B/parts, ...]
    (global ids, this rank's batch block). "mean" / "sum" return the loss of the whole batch
    on every rank (a mean over all non-ignored targets, as F.cross_entropy); "none" returns
    this rank's block of per-token losses."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross entropy reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
    per_token = vocab_parallel_cross_entropy(
        logits, target, group=mesh.group(placement.hidden_axis), vocab_start=vocab_start, vocab_size=vocab_size,
        ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    if reduction == "none":
        return per_token
    batch_group = mesh.group(*placement.batch_axes)
    total = per_token.sum()
    if reduction == "mean":
        # the count in at least fp32: bf16 holds integers exactly only up to 256
        stat = torch.promote_types(total.dtype, torch.float32)
        count = ops.all_reduce((target != ignore_index).sum().to(stat), batch_group)
        total = (total.to(stat) / count).to(total.dtype)
    # every rank continues with the same scalar: sum forward, identity backward
    return comm.reduce_from(total, batch_group)


class GridClassifier(placements.GridModule):
    """``nn.Linear(H, C)`` producing full logits: x [B/parts, ..., H/q] -> [B/parts, ..., C].
    H must be divisible by q * size(param_axes) (q*q in 2D / 2.5D, q^3 in 3D), or by q when
    tied to a vocabulary-parallel embedding. ``tie_to``: an embedding of the same mesh and placement
    with table [C, H] used as the weight (module docstring); the placement defaults to its placement."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True, *, mesh, tie_to=None, dtype=None,
                 device=None, placement: ActivationPlacement | None = None):
        super().__init__()
        if tie_to is not None and dtype is None:
            dtype = tie_to.weight.dtype
        # tied, the weight drawn here is dropped: the bias is drawn as the serial tied model draws it
        serial = nn.Linear(in_features, num_classes, bias, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, placement, tie_to=tie_to)

    def _setup(self, serial: nn.Linear, mesh, device, placement: ActivationPlacement | None = None,
               tie_to=None) -> None:
        self._bind(mesh, placement or getattr(tie_to, "placement", None))
        self.in_features, self.num_classes = serial.in_features, serial.out_features
        self.tied, self.tied_vocab_parallel = tie_to is not None, isinstance(tie_to, GridVocabParallelEmbedding)
        if tie_to is None:
            placements.check_hidden_parts(type(self).__name__, "in_features", self.in_features, mesh, self.placement)
            placements.hidden_param(self, "weight", serial.weight, 1, mesh, self.placement, device)
        else:
            self._tie(tie_to)
        if serial.bias is None:
            self.register_parameter("bias", None)
        else:
            spec = ShardSpec((self.num_classes,), (0,), (self.num_classes,), (), ("tp",))
            shard_param(self, "bias", serial.bias, spec, device if device is not None else self.weight.device)

    def _tie(self, tie_to) -> None:
        name, h, c = type(self).__name__, self.in_features, self.num_classes
        same_place = isinstance(tie_to, (GridEmbedding, GridVocabParallelEmbedding)) and tie_to.mesh is self.mesh \
            and tie_to.placement == self.placement
        if not same_place or (tie_to.num_embeddings, tie_to.embedding_dim) != (c, h):
            raise ValueError(f"{name}(in_features={h}, num_classes={c}) cannot tie to {tie_to}; tie to an Embedding "
                             f"or VocabParallelEmbedding of the same mode, mesh and placement ({self.placement}) with "
                             f"embedding_dim=in_features, num_embeddings=num_classes")
        tie_param(self, "weight", tie_to)

    def class_weight(self) -> torch.Tensor:
        """W's hidden block for this rank, [C, H/q] (differentiable)."""
        if self.tied_vocab_parallel:
            return vocab_table(self.weight, self.mesh, self.placement)[: self.num_classes]
        return placements.gather_hidden_param(self.weight, -1, self.mesh, self.placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/parts, ..., H/q] -> logits [B/parts, ..., C] (same on the hidden group)."""
        self._check_input(x, self.in_features)
        weight = self.class_weight()  # [C, H/q]
        logits = comm.reduce_from(torch.matmul(x, weight.t()), self.mesh.group(self.placement.hidden_axis))
        if self.bias is not None:
            logits = logits + comm.copy_to(self.bias, self.mesh.group(*self.placement.batch_axes))
        return logits

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """[B/parts, ..., C] -> [B, ..., C] on every rank."""
        return placements.gather_batch(y_local, self.mesh, self.placement)

    def extra_repr(self) -> str:
        tied = ", tied" if self.tied else ""
        return f"in_features={self.in_features}, num_classes={self.num_classes}, placement=({self.placement}){tied}"


class GridLMHead(placements.GridModule):
    """Base of the grid LM heads: the weight E [V, H] placed as the vocabulary-parallel
    embedding of the same placement (so ``tie_to`` shares it), vocab-parallel logits in
    ``output_placement``, their loss, targets and gathering. A subclass writes ``forward``,
    ``_finish`` (vocab_per_rank, vocab_start) and ``_place_bias``."""

    def __init__(self, in_features: int, vocab_size: int, bias: bool = False, *, mesh, tie_to=None, dtype=None,
                 device=None, placement: ActivationPlacement | None = None):
        super().__init__()
        name = type(self).__name__
        if tie_to is None:
            serial = nn.Linear(in_features, vocab_size, bias, dtype=dtype, device="cpu")
            self._setup(serial, mesh, device, placement)
            return
        if bias:
            raise ValueError(f"{name}(tie_to=...) shares the embedding's weight and has no bias; pass bias=False")
        self._bind(mesh, placement or getattr(tie_to, "placement", None))
        same_place = isinstance(tie_to, GridVocabParallelEmbedding) and tie_to.mesh is mesh \
            and tie_to.placement == self.placement
        if not same_place or (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, in_features):
            raise ValueError(f"{name}(in_features={in_features}, vocab_size={vocab_size}) cannot tie to {tie_to}; "
                             f"tie to a VocabParallelEmbedding of the same mesh and placement with "
                             f"embedding_dim=in_features, num_embeddings=vocab_size")
        self.in_features, self.vocab_size = in_features, vocab_size
        tie_param(self, "weight", tie_to)
        self.register_parameter("bias", None)
        self._finish()

    def _setup(self, serial: nn.Linear, mesh, device, placement: ActivationPlacement | None = None) -> None:
        self._bind(mesh, placement)
        self.in_features, self.vocab_size = serial.in_features, serial.out_features
        q = mesh.q
        placements.check_divisible(type(self).__name__, "in_features", self.in_features, q, f"q={q}")
        vocab_parallel_param(self, serial.weight, mesh, self.placement, device)
        self._finish()
        if serial.bias is None:
            self.register_parameter("bias", None)
        else:
            self._place_bias(serial.bias, device)

    def loss(self, logits: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
        """Cross entropy of this head's logits against target ids [B/parts, ...] (this rank's
        batch block, ``shard_target``); kwargs: ignore_index, label_smoothing, reduction."""
        return grid_cross_entropy(logits, target, mesh=self.mesh, placement=self.output_placement,
                                  vocab_start=self.vocab_start, vocab_size=self.vocab_size, **kwargs)

    def shard_target(self, target_full: torch.Tensor) -> torch.Tensor:
        """Target ids [B, ...] -> this rank's batch block [B/parts, ...] in ``output_placement``."""
        return placements.shard_batch(target_full, self.mesh, self.output_placement, type(self).__name__)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel [B/parts, ..., V_pad/q] -> [B, ..., V] (padding dropped)."""
        return super().gather_output(y_local)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, vocab_size={self.vocab_size}, placement=({self.placement})"


class SummaLMHead(GridLMHead):
    """Base of LMHead2D / LMHead2p5D: vocabulary-parallel logits by SUMMA x E^T.
    x [B/parts, ..., H/q] -> logits [B/parts, ..., V_pad/q]."""

    any_placement = False

    def _place_bias(self, bias: torch.Tensor, device) -> None:
        placements.block_param(self, "bias", bias, 0, self.mesh, self.placement, device)

    def _finish(self) -> None:
        self.grid = Grid2D(self.mesh)
        self.vocab_per_rank = get_shard_spec(self, "weight").local_shape[0]
        self.vocab_start = self.grid.j * self.vocab_per_rank  # logits hold vocabulary block j

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B/parts, ..., H/q] -> vocab-parallel logits [B/parts, ..., V_pad/q]."""
        self._check_input(x, self.in_features)
        weight = self.weight
        if self.placement.replica_axes:
            weight = comm.copy_to(weight, self.mesh.group(*self.placement.replica_axes))
        logits = summa_linear_t(x, weight, self.grid)
        if self.bias is not None:
            logits = logits + placements.use_block_param(self.bias, self.mesh, self.placement)
        return logits


class Classifier2D(GridClassifier):
    """Classifier on the 2D layout: x [B/q, ..., H/q] -> logits [B/q, ..., C]."""

    mode = "2d"


class LMHead2D(SummaLMHead):
    """LM head on the 2D layout, optionally tied to a ``VocabParallelEmbedding2D``:
    x [B/q, ..., H/q] -> vocab-parallel logits [B/q, ..., V_pad/q] (vocab over tp_col)."""

    mode = "2d"
