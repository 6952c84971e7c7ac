"""1D tensor-parallel embeddings: vocabulary split (Megatron) and hidden split.

``VocabParallelEmbedding1D``: rank r holds rows ``[r*V_local, (r+1)*V_local)`` of the table,
``V_local = ceil(V / p)``; the last ranks' rows past V are zero padding that the ShardSpec marks
invisible (GPT-2's 50257 works with any tp, and ``full_state_dict`` gives ``[V, H]``). Each rank
looks up the ids it owns, writes zeros for the others, and one all-reduce (``reduce_from``)
sums the pieces; with ``sequence_parallel`` a reduce-scatter leaves ``[b, s/p, H]`` instead.

``Embedding1D``: rank r holds columns ``[r*H/p, (r+1)*H/p)`` of every row; a lookup gives
``[.., H/p]`` and ``gather_from`` concatenates the hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.comm import collectives as comm
from shardzoo.layers.common_1d import (
    SEQ_DIM,
    leave_sequence_parallel,
    local_param,
    require_divisible,
    require_sequence_placement,
    split_spec,
)
from shardzoo.layers.module import ParallelModule
from shardzoo.layers.token_ids import check_token_ids


def vocab_block_lookup(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                       padding_idx: int | None) -> torch.Tensor:
    """Rows of the vocabulary block ``weight`` [rows, D] (ids vocab_start .. vocab_start+rows-1)
    for global ids [...] -> [..., D]; an id outside the block gives zeros (another rank holds
    it), and ``padding_idx`` keeps its zero gradient where it falls inside the block."""
    rows = weight.shape[0]
    local = ids - vocab_start
    elsewhere = (local < 0) | (local >= rows)
    local = torch.where(elsewhere, torch.zeros_like(local), local)
    pad = None
    if padding_idx is not None and 0 <= padding_idx - vocab_start < rows:
        pad = padding_idx - vocab_start
    return F.embedding(local, weight, padding_idx=pad).masked_fill(elsewhere.unsqueeze(-1), 0.0)


class VocabParallelEmbedding1D(ParallelModule):
    """Embedding table split along the vocabulary, padded to a multiple of tp.

    Args:
        num_embeddings, embedding_dim, padding_idx: as ``nn.Embedding``.
        mesh: the ParallelMesh (tp axis).
        sequence_parallel: return this rank's sequence chunk ``[b, s/p, H]`` (reduce-scatter)
            instead of the replicated ``[b, s, H]`` (all-reduce); ids must then be ``[b, s]``.
        dtype, device: of the weight; initialised as the serial ``nn.Embedding`` (full table
            drawn on CPU from the current torch RNG, this rank's rows kept).

    Shapes: ids ``[...]`` (global ids in ``[0, V)``, replicated) -> ``[..., H]`` (``[b, s/p, H]``
    with SP). Ids outside ``[0, V)`` raise ``IndexError`` (layers/token_ids.py), as in ``nn.Embedding``.
    Attributes: ``vocab_start`` (first global id held here), ``num_embeddings_per_rank``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        mesh,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        serial = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, dtype=dtype)
        self._setup(serial, mesh, device, sequence_parallel=sequence_parallel)

    def _setup(self, serial: nn.Embedding, mesh, device, sequence_parallel: bool = False) -> None:
        num_embeddings, embedding_dim = serial.num_embeddings, serial.embedding_dim
        device = device if device is not None else serial.weight.device
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, serial.padding_idx
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        spec = split_spec((num_embeddings, embedding_dim), 0, mesh)
        local_param(self, "weight", serial.weight, spec, device)
        self.vocab_start = spec.offsets[0]
        self.num_embeddings_per_rank = spec.local_shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(ids, self.num_embeddings, type(self).__name__)
        out = vocab_block_lookup(ids, self.weight, self.vocab_start, self.padding_idx)
        if self.sequence_parallel:
            require_sequence_placement("VocabParallelEmbedding1D", out)
            return comm.reduce_scatter(out, self.mesh.tp_group, SEQ_DIM)
        return comm.reduce_from(out, self.mesh.tp_group)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """``[b, s/p, H]`` -> ``[b, s, H]`` under sequence parallelism; identity otherwise."""
        return leave_sequence_parallel(y_local, self.mesh) if self.sequence_parallel else y_local

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"tp={self.mesh.tp_size}, rows_per_rank={self.num_embeddings_per_rank}, "
                f"sequence_parallel={self.sequence_parallel}")


class Embedding1D(ParallelModule):
    """Embedding table split along the hidden dim; output gathered to ``[..., H]``.

    Args: as ``nn.Embedding`` plus ``mesh``; ``embedding_dim`` must divide by tp.
    Shapes: ids ``[...]`` -> ``[..., H]`` replicated.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        mesh,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        require_divisible("Embedding1D", "embedding_dim", embedding_dim, mesh.tp_size)
        self._setup(nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, dtype=dtype), mesh, device)

    def _setup(self, serial: nn.Embedding, mesh, device) -> None:
        num_embeddings, embedding_dim = serial.num_embeddings, serial.embedding_dim
        require_divisible("Embedding1D", "embedding_dim", embedding_dim, mesh.tp_size)
        device = device if device is not None else serial.weight.device
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, serial.padding_idx
        self.mesh = mesh
        local_param(self, "weight", serial.weight, split_spec((num_embeddings, embedding_dim), 1, mesh), device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(ids, self.num_embeddings, type(self).__name__)
        out = F.embedding(ids, self.weight, padding_idx=self.padding_idx)
        return comm.gather_from(out, self.mesh.tp_group, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, tp={self.mesh.tp_size}"
