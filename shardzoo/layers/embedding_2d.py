"""Embeddings on the 2D layout, and the placement-generic bases the 2.5D / 3D ones subclass.

Both take token ids split like the activations' batch (``shard_input``: [B, S] ->
[B/parts, S]) and return [B/parts, S, H/q] in the layer's placement.

* ``GridEmbedding`` (nn.Embedding, table split along the hidden dim): the table [V, H] is cut
  into q * size(param_axes) hidden chunks, one per rank (replicated over tp_dep in 2.5D); the
  forward all-gathers the chunks over ``param_axes`` into this rank's hidden block [V, H/q].
* ``GridVocabParallelEmbedding`` (table split along the vocabulary too, for large V): the
  vocabulary is split over the minor batch axis ``vocab_axis`` (2D / 2.5D: tp_row; 3D: J) and,
  in 3D, further over the other batch axis (gathered in forward); the hidden over
  ``hidden_axis``. Forward: all-gather the ids over ``vocab_axis``, masked lookup in the local
  vocabulary block, reduce-scatter the partial embeddings back over ``vocab_axis`` (which sums
  the vocabulary blocks). The vocabulary is padded to a multiple of the vocabulary parts with
  zero rows that no id reaches and no checkpoint shows. The 2D / 2.5D placement (vocab block i,
  hidden block j on rank (i, j)) is what the LM head's SUMMA uses, so the two can be tied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo import comm
from shardzoo.comm import ops
from shardzoo.comm.mesh import default_device
from shardzoo.layers import placements
from shardzoo.layers.embedding_1d import vocab_block_lookup
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec, shard_param
from shardzoo.layers.token_ids import check_token_ids


def vocab_axes(placement: ActivationPlacement) -> tuple[str, tuple[str, ...]]:
    """(vocab_axis, vocab_sub_axes) of a vocabulary-split table in ``placement``."""
    vocab_axis = placement.batch_axes[-1]
    return vocab_axis, tuple(a for a in placement.param_axes if a != vocab_axis)


def vocab_parallel_param(module: nn.Module, weight: torch.Tensor, mesh, placement: ActivationPlacement,
                         device) -> nn.Parameter:
    """Register as ``module.weight`` this rank's block of a [V, H] table: vocabulary chunk
    ``vocab_rank * sub + sub_rank`` of ``size(vocab_axis) * sub`` (padded), hidden block
    ``hidden_rank`` of q."""
    vocab_axis, sub_axes = vocab_axes(placement)
    sub = mesh.size(*sub_axes) if sub_axes else 1
    index = mesh.rank(vocab_axis) * sub + (mesh.rank(*sub_axes) if sub_axes else 0)
    hidden_axis = placement.hidden_axis
    split = {0: (index, mesh.size(vocab_axis) * sub), 1: (mesh.rank(hidden_axis), mesh.size(hidden_axis))}
    spec = ShardSpec.split(tuple(weight.shape), split, (hidden_axis, vocab_axis) + sub_axes, placement.replica_axes)
    return shard_param(module, "weight", weight, spec, device if device is not None else default_device(mesh))


def vocab_block(weight: torch.Tensor, mesh, placement: ActivationPlacement) -> torch.Tensor:
    """This rank's vocabulary block [V_pad/size(vocab_axis), H/q] of a :func:`vocab_parallel_param`
    (differentiable): gathered over the vocabulary sub-axes (gradient reduce-scattered back),
    gradient summed over the replica axes."""
    _, sub_axes = vocab_axes(placement)
    if placement.replica_axes:
        weight = comm.copy_to(weight, mesh.group(*placement.replica_axes))
    if sub_axes:
        weight = comm.all_gather(weight, mesh.group(*sub_axes), 0)
    return weight


def vocab_table(weight: torch.Tensor, mesh, placement: ActivationPlacement) -> torch.Tensor:
    """The whole padded table's hidden block [V_pad, H/q] of a :func:`vocab_parallel_param`:
    :func:`vocab_block` gathered over ``vocab_axis`` too, whose ranks hold other batch rows,
    so the gradient is reduce-scattered (summed) there. A classifier tied to the table uses it."""
    return comm.all_gather(vocab_block(weight, mesh, placement), mesh.group(vocab_axes(placement)[0]), 0)


class _GridEmbeddingBase(placements.GridModule):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *, mesh,
                 dtype=None, device=None, placement: ActivationPlacement | None = None):
        super().__init__()
        serial = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype, device="cpu")
        self._setup(serial, mesh, device, placement)

    def _setup(self, serial: nn.Embedding, mesh, device, placement: ActivationPlacement | None = None) -> None:
        self._bind(mesh, placement)
        self.num_embeddings, self.embedding_dim = serial.num_embeddings, serial.embedding_dim
        self.padding_idx = serial.padding_idx
        self._place(serial.weight, device)

    def shard_input(self, ids_full: torch.Tensor) -> torch.Tensor:
        """Token ids [B, ...] (replicated) -> this rank's batch block [B/parts, ...]."""
        return placements.shard_batch(ids_full, self.mesh, self.placement, type(self).__name__)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"placement=({self.placement})")


class GridEmbedding(_GridEmbeddingBase):
    """nn.Embedding with the table split along the hidden dim (module docstring).
    ids [B/parts, ...] -> [B/parts, ..., H/q]."""

    def _place(self, weight: torch.Tensor, device) -> None:
        placements.check_hidden_parts(type(self).__name__, "embedding_dim", self.embedding_dim, self.mesh,
                                      self.placement)
        placements.hidden_param(self, "weight", weight, 1, self.mesh, self.placement, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B/parts, ...] (this rank's batch block, ``shard_input``) -> [B/parts, ..., H/q]
        in ``self.placement``: rows of the gathered hidden block [V, H/q] of the table."""
        check_token_ids(ids, self.num_embeddings, type(self).__name__)
        weight = placements.gather_hidden_param(self.weight, -1, self.mesh, self.placement)  # [V, H/q]
        return F.embedding(ids, weight, self.padding_idx)


class GridVocabParallelEmbedding(_GridEmbeddingBase):
    """nn.Embedding with the table split along the vocabulary and the hidden dim (module
    docstring). ids [B/parts, ...] -> [B/parts, ..., H/q]. Attributes: ``vocab_axis``,
    ``vocab_sub_axes`` (further vocabulary split, gathered in forward), ``vocab_start`` and
    ``vocab_block`` (global id range of this rank's gathered block)."""

    def _place(self, weight: torch.Tensor, device) -> None:
        q = self.mesh.size(self.placement.hidden_axis)
        placements.check_divisible(type(self).__name__, "embedding_dim", self.embedding_dim, q, f"q={q}")
        vocab_parallel_param(self, weight, self.mesh, self.placement, device)
        self.vocab_axis, self.vocab_sub_axes = vocab_axes(self.placement)
        sub = self.mesh.size(*self.vocab_sub_axes) if self.vocab_sub_axes else 1
        self.vocab_block = get_shard_spec(self, "weight").local_shape[0] * sub
        self.vocab_start = self.mesh.rank(self.vocab_axis) * self.vocab_block

    def gathered_weight(self) -> torch.Tensor:
        """This rank's vocabulary block [V_pad/vocab_parts*sub, H/q] (differentiable)."""
        return vocab_block(self.weight, self.mesh, self.placement)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B/parts, ...] (this rank's batch block, ``shard_input``) -> [B/parts, ..., H/q]
        in ``self.placement``. Inside: ids gathered over ``vocab_axis`` [B/parts * size(vocab_axis),
        ...], lookup in the local vocabulary block [vocab_block, H/q] (other ids give zeros),
        reduce-scatter over ``vocab_axis`` back to [B/parts, ..., H/q]."""
        group = self.mesh.group(self.vocab_axis)
        all_ids = ops.all_gather(ids.contiguous(), group, 0)  # ids of every vocab block's rank
        # checked after the gather the lookup needs anyway: the whole vocabulary group raises together
        check_token_ids(all_ids, self.num_embeddings, type(self).__name__)
        weight = self.gathered_weight()  # [vocab_block, D_local]
        out = vocab_block_lookup(all_ids, weight, self.vocab_start, self.padding_idx)
        return comm.reduce_scatter(out, group, 0)


class Embedding2D(GridEmbedding):
    """``nn.Embedding`` on a tp_mode="2d" mesh, table split along the hidden dim (embedding_dim
    divisible by q*q). ids [B/q, ...] -> [B/q, ..., H/q]."""

    mode = "2d"


class VocabParallelEmbedding2D(GridVocabParallelEmbedding):
    """``nn.Embedding`` on a tp_mode="2d" mesh, rank (i, j) holding vocabulary block i (padded
    to a multiple of q) and hidden block j (embedding_dim divisible by q).
    ids [B/q, ...] -> [B/q, ..., H/q]."""

    mode = "2d"
