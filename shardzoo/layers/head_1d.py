"""LM head and classifier for 1D tensor parallelism.

``LMHead1D``: vocab-split logits for the parallel loss.

The weight ``[V, H]`` (``nn.Linear(H, V)``'s layout) is split along the vocabulary exactly as
``VocabParallelEmbedding1D`` splits its table (``ceil(V/p)`` rows per rank, zero padding rows
past V), so ``tie_to=embedding`` can share the embedding's Parameter. The logits stay
vocab-parallel ``[b, s, ceil(V/p)]`` for :func:`vocab_parallel_cross_entropy` (``self.loss``);
padding columns are ignored there, and ``gather_output`` drops them.

Communication: like a column layer -- ``copy_to`` on entry (all-reduce of dX in backward), or
with ``sequence_parallel`` an all-gather of ``[b, s/p, H]`` (reduce-scatter in backward).

``Classifier1D``: a few-class head (ViT) on the replicated activation: every tp rank holds the
whole ``nn.Linear(H, C)`` and computes the same full logits, with no communication. With
``tie_to=`` its weight is an embedding's table [C, H]: a replicated ``nn.Embedding``'s as it is,
an ``Embedding1D``'s or ``VocabParallelEmbedding1D``'s gathered over tp in forward
(``gather_from``: every rank computes the same logits, so each keeps its own slice of the
weight's gradient), vocabulary padding dropped. The bias stays the classifier's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.comm import collectives as comm
from shardzoo.layers.common_1d import (SEQ_DIM, enter_sequence_parallel, local_param, require_sequence_placement,
                                       split_spec)
from shardzoo.layers.cross_entropy import vocab_parallel_cross_entropy
from shardzoo.layers.embedding_1d import Embedding1D, VocabParallelEmbedding1D
from shardzoo.layers.module import ParallelModule
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec, shard_param, tie_param


class LMHead1D(ParallelModule):
    """``logits = x W^T (+ b)`` with W ``[V, H]`` split along V over tp.

    Args:
        in_features: hidden size H.
        vocab_size: number of classes / tokens V (any value; padded to a multiple of tp).
        bias: add a (vocab-split) bias; not allowed with ``tie_to``.
        mesh: the ParallelMesh.
        tie_to: a ``VocabParallelEmbedding1D`` whose weight this head uses (weight tying).
        gather_output: return full ``[b, s, V]`` logits (padding removed) instead of the
            vocab-parallel ``[b, s, ceil(V/p)]``.
        sequence_parallel: the input is ``[b, s/p, H]``.
        dtype, device: as ``nn.Linear``; initialised as ``nn.Linear(H, V, bias)``.

    Shapes: ``[b, s_in, H] -> [b, s, ceil(V/p)]`` (``[b, s, V]`` with gather_output).
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        bias: bool = False,
        *,
        mesh,
        tie_to: VocabParallelEmbedding1D | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if tie_to is None:
            serial = nn.Linear(in_features, vocab_size, bias, dtype=dtype)
            self._setup(serial, mesh, device, gather_output=gather_output, sequence_parallel=sequence_parallel)
            return
        self._bind(in_features, vocab_size, mesh, gather_output, sequence_parallel)
        if bias:
            raise ValueError("LMHead1D(tie_to=...) shares the embedding's weight and has no bias; "
                             "pass bias=False")
        if (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, in_features):
            raise ValueError(
                f"LMHead1D(in_features={in_features}, vocab_size={vocab_size}) cannot tie to an embedding "
                f"of num_embeddings={tie_to.num_embeddings}, embedding_dim={tie_to.embedding_dim}; build the head "
                f"with in_features=embedding_dim and vocab_size=num_embeddings"
            )
        if tie_to.mesh is not mesh:
            raise ValueError("LMHead1D(tie_to=...) must use the embedding's mesh; pass mesh=embedding.mesh")
        tie_param(self, "weight", tie_to)
        self.register_parameter("bias", None)

    def _bind(self, in_features: int, vocab_size: int, mesh, gather_output: bool, sequence_parallel: bool):
        self.in_features, self.vocab_size, self.mesh = in_features, vocab_size, mesh
        self.output_gathered, self.sequence_parallel = gather_output, sequence_parallel
        spec = split_spec((vocab_size, in_features), 0, mesh)
        self.vocab_start, self.vocab_per_rank = spec.offsets[0], spec.local_shape[0]
        return spec

    def _setup(self, serial: nn.Linear, mesh, device, gather_output: bool = False,
               sequence_parallel: bool = False) -> None:
        spec = self._bind(serial.in_features, serial.out_features, mesh, gather_output, sequence_parallel)
        device = device if device is not None else serial.weight.device
        local_param(self, "weight", serial.weight, spec, device)
        local_param(self, "bias", serial.bias, split_spec((self.vocab_size,), 0, mesh), device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.mesh.tp_group
        if self.sequence_parallel:
            require_sequence_placement("LMHead1D", x)
            x = comm.all_gather(x, group, SEQ_DIM)
        else:
            x = comm.copy_to(x, group)
        logits = F.linear(x, self.weight, self.bias)
        return self._gather(logits) if self.output_gathered else logits

    def loss(self, logits: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
        """``vocab_parallel_cross_entropy`` of this head's vocab-parallel logits ``[b, s, V/p]``
        against global ids ``[b, s]``; kwargs: ignore_index, label_smoothing, reduction."""
        if self.output_gathered:
            loss = F.cross_entropy(logits.flatten(0, -2), target.flatten(), **kwargs)
            return loss.reshape(target.shape) if loss.dim() else loss
        return vocab_parallel_cross_entropy(logits, target, group=self.mesh.tp_group, vocab_start=self.vocab_start,
                                            vocab_size=self.vocab_size, **kwargs)

    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """``[b, s, H]`` -> ``[b, s/p, H]`` under sequence parallelism; identity otherwise."""
        return enter_sequence_parallel(x_full, self.mesh) if self.sequence_parallel else x_full

    def shard_target(self, target_full: torch.Tensor) -> torch.Tensor:
        """Target ids ``[b, s]`` -> the same tensor: the logits hold every row and position
        (also with ``sequence_parallel``, whose input is gathered), so layout-generic code can
        call ``head.shard_target`` as on the grid heads."""
        return target_full

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel ``[.., ceil(V/p)]`` -> full ``[.., V]`` logits, padding dropped."""
        return y_local if self.output_gathered else self._gather(y_local)

    def _gather(self, y_local: torch.Tensor) -> torch.Tensor:
        return comm.gather_from(y_local, self.mesh.tp_group, -1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
                f"tp={self.mesh.tp_size}, vocab_per_rank={self.vocab_per_rank}, gather_output={self.output_gathered}, "
                f"sequence_parallel={self.sequence_parallel}")


class Classifier1D(ParallelModule):
    """``nn.Linear(H, C)`` replicated on every tp rank: x [b, ..., H] -> logits [b, ..., C].

    Args: as ``nn.Linear`` (``num_classes`` = out_features) plus ``mesh``, and ``tie_to``: an
    ``nn.Embedding``, ``Embedding1D`` or ``VocabParallelEmbedding1D`` of ``num_embeddings=C,
    embedding_dim=H`` whose table is the weight (module docstring; the bias is drawn as the
    serial tied model draws it). Untied, or tied to a replicated ``nn.Embedding``, the
    parameters carry no ShardSpec (replicated), so its state dict is the serial one; tied to a
    split table the weight has the table's spec and the bias a replicated one."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True, *, mesh, tie_to: nn.Module | None = None,
                 dtype=None, device=None):
        super().__init__()
        if tie_to is not None and dtype is None:
            dtype = tie_to.weight.dtype
        # tied, the weight drawn here is dropped: the bias is drawn as the serial tied model draws it
        self._setup(nn.Linear(in_features, num_classes, bias, dtype=dtype), mesh, device, tie_to=tie_to)

    def _setup(self, serial: nn.Linear, mesh, device, tie_to: nn.Module | None = None) -> None:
        self.mesh, self.in_features, self.num_classes = mesh, serial.in_features, serial.out_features
        self.tied, self.gather_dim = tie_to is not None, None
        if tie_to is None:
            device = device if device is not None else serial.weight.device
            self.weight = nn.Parameter(serial.weight.detach().to(device, copy=True))
        else:
            self.gather_dim = self._tie(tie_to)
            device = device if device is not None else self.weight.device
        bias = serial.bias
        if bias is None:
            self.register_parameter("bias", None)
        elif get_shard_spec(self, "weight") is None:
            self.bias = nn.Parameter(bias.detach().to(device, copy=True))
        else:  # a module recording a spec states every parameter's: the bias is replicated
            shard_param(self, "bias", bias, ShardSpec((self.num_classes,), (0,), (self.num_classes,), (), ("tp",)),
                        device)

    def _tie(self, tie_to: nn.Module) -> int | None:
        """Share ``tie_to``'s table as the weight; the dim it is split along over tp (None: whole)."""
        dims = {VocabParallelEmbedding1D: 0, Embedding1D: 1, nn.Embedding: None}
        kind = next((k for k in dims if isinstance(tie_to, k)), None)
        h, c = self.in_features, self.num_classes
        if kind is None or (tie_to.num_embeddings, tie_to.embedding_dim) != (c, h):
            raise ValueError(f"Classifier1D(in_features={h}, num_classes={c}) cannot tie to {tie_to}; tie to an "
                             f"nn.Embedding, Embedding1D or VocabParallelEmbedding1D with embedding_dim=in_features, "
                             f"num_embeddings=num_classes")
        if dims[kind] is not None and tie_to.mesh is not self.mesh:
            raise ValueError("Classifier1D(tie_to=...) must use the embedding's mesh; pass mesh=embedding.mesh")
        tie_param(self, "weight", tie_to)
        return dims[kind]

    def class_weight(self) -> torch.Tensor:
        """The whole weight [C, H] (differentiable): the tied table gathered over tp if split."""
        if self.gather_dim is None:
            return self.weight
        return comm.gather_from(self.weight, self.mesh.tp_group, self.gather_dim)[: self.num_classes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.class_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"
                + (", tied" if self.tied else ""))
