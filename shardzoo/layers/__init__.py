"""Parallel layers for every tp_mode, ring / Ulysses attention, and ShardSpec.

``layout_of(mesh)`` is the mode's :class:`TensorLayout`, the one factory the engine and blocks of
one's own are written against. Every sharded parameter has a ShardSpec (shard_spec.py); every
module has ``.mesh``, ``from_serial(module, mesh, ...)`` and differentiable ``shard_input`` /
``gather_output``. Ready attention and MLP blocks are plain modules (``shardzoo.models.Attention``
/ ``MLP``) that ``shardzoo.parallelize`` splits with a plan, as it does the families built on them.
"""

from shardzoo.layers.cross_entropy import vocab_parallel_cross_entropy
from shardzoo.layers.embedding_1d import Embedding1D, VocabParallelEmbedding1D
from shardzoo.layers.embedding_2d import Embedding2D, VocabParallelEmbedding2D
from shardzoo.layers.embedding_2p5d import Embedding2p5D, PatchEmbedding2p5D, VocabParallelEmbedding2p5D
from shardzoo.layers.embedding_3d import Embedding3D, PatchEmbedding3D, VocabParallelEmbedding3D
from shardzoo.layers.head_1d import Classifier1D, LMHead1D
from shardzoo.layers.head_2d import Classifier2D, LMHead2D
from shardzoo.layers.head_2p5d import Classifier2p5D, LMHead2p5D
from shardzoo.layers.head_3d import Classifier3D, LMHead3D
from shardzoo.layers.placements import (ActivationPlacement, canonical_placement, gather_activation, gather_batch,
                                     shard_activation, shard_batch)
from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.linear_2d import ParallelLinear2D
from shardzoo.layers.linear_2p5d import ParallelLinear2p5D
from shardzoo.layers.linear_3d import ParallelLinear3D
from shardzoo.layers.norm_1d import LayerNorm1D, RMSNorm1D
from shardzoo.layers.norm_2d import LayerNorm2D, RMSNorm2D
from shardzoo.layers.norm_2p5d import LayerNorm2p5D, RMSNorm2p5D
from shardzoo.layers.norm_3d import LayerNorm3D, RMSNorm3D
from shardzoo.layers.patch_embedding_1d import PatchEmbedding1D
from shardzoo.layers.patch_embedding_2d import PatchEmbedding2D
from shardzoo.layers.packing import cu_seqlens_from_position_ids, split_documents
from shardzoo.layers.ring_attention import RingAttentionFunction, ring_attention
from shardzoo.layers.rng_streams import ParallelDropout, RNGStreams, dropout, manual_seed, rng_streams, tp_rng
from shardzoo.layers.sequence import gather_padding_mask, gather_sequence, shard_padding_mask, shard_sequence
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import ShardSpec, gather_full, get_shard_spec, set_shard_spec
from shardzoo.layers.ulysses import ulysses_attention
from shardzoo.layers.tensor_layout import Layout1D, Layout2D, Layout2p5D, Layout3D, TensorLayout, layout_of

__all__ = [
    # 1D
    "ParallelLinear1D", "VocabParallelEmbedding1D", "Embedding1D", "LMHead1D", "LayerNorm1D",
    "RMSNorm1D", "Classifier1D", "PatchEmbedding1D",
    # 2D / 2.5D / 3D
    "ParallelLinear2D", "ParallelLinear2p5D", "ParallelLinear3D", "LayerNorm2D", "LayerNorm2p5D", "LayerNorm3D",
    "RMSNorm2D", "RMSNorm2p5D", "RMSNorm3D",
    "Embedding2D", "Embedding2p5D", "Embedding3D", "VocabParallelEmbedding2D", "VocabParallelEmbedding2p5D",
    "VocabParallelEmbedding3D", "PatchEmbedding2D", "PatchEmbedding2p5D", "PatchEmbedding3D", "Classifier2D",
    "Classifier2p5D", "Classifier3D", "LMHead2D", "LMHead2p5D", "LMHead3D",
    "ActivationPlacement", "canonical_placement", "shard_activation", "gather_activation", "shard_batch",
    "gather_batch",
    # loss, dropout
    "vocab_parallel_cross_entropy", "RNGStreams", "ParallelDropout", "dropout", "manual_seed", "rng_streams", "tp_rng",
    # sequence parallelism
    "ring_attention", "RingAttentionFunction", "ulysses_attention", "shard_sequence", "gather_sequence",
    "shard_padding_mask", "gather_padding_mask", "cu_seqlens_from_position_ids", "split_documents",
    # the one factory per tp_mode
    "TensorLayout", "Layout1D", "Layout2D", "Layout2p5D", "Layout3D", "layout_of",
    # sharding metadata
    "ShardSpec", "full_state_dict", "gather_full", "get_shard_spec", "set_shard_spec",
]  # fmt: skip
