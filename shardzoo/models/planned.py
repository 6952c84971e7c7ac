"""The stage builder of the model families: a family is a plain torch model with a plan, and this
base class builds one pipeline stage of it and splits it by the engine every user gets.

A family file writes plain modules only (``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``,
``nn.Dropout``, ``F.scaled_dot_product_attention``) and never sees a mesh:

* ``build(config, blocks)``: create this stage's modules (the embeddings when ``is_first``,
  blocks ``blocks``, the head when ``is_last``), called on the meta device;
* ``forward(x, key_padding_mask=None)``: the plain forward of those modules;
* ``plan``: {module pattern: style} (shardzoo/parallel/plan.py), the same for every stage.

The constructor then splits the stage over the mesh (``shardzoo.parallel.stage.split_stage``:
tp blocks from the plan, sequence-parallel attention through the SDPA calls, dropout streams,
activation checkpointing) and gives this rank's pieces storage and the seeded serial init
(pipeline.py). Parameter names are the plain modules' names, so checkpoints keep them.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from shardzoo.layers import replicas
from shardzoo.layers.attention_core import check_heads
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.models import common
from shardzoo.models.pipeline import StagedModel
from shardzoo.parallel.patch_embedding import mask_padding
from shardzoo.parallel.stage import split_stage


class PlannedModel(StagedModel):
    """A family model on ``mesh``; ``stage=(k, n)`` / ``stage_layers`` build one pipeline stage.

    Args:
        config: the family's config dataclass. mesh: ParallelMesh (tp in any mode, sp, dp, pp).
        stage, stage_layers: pipeline stage (models/common.stage_blocks); None: whole model.
        sp_mode: "ring" or "ulysses" attention over sp. checkpointing: recompute each block
            in backward (activation checkpointing).
        sequence_parallel: Megatron sequence parallelism between the blocks in 1d with tp > 1
            (parallel/megatron_sp.py; default on); False keeps those activations replicated.
            A pipeline stage (``stage`` given) keeps them replicated: the stages' sends and
            receives carry whole activations, which the sequence-sharded blocks do not yet
            hand to torch's pipelining.
        device: of the parameters ("meta": shapes only). seed: of the init (default
            ``torch.initial_seed()``).

    Subclasses set ``family``, ``causal``, ``plan``, ``layers_field`` (the config field
    counting blocks) and ``positions_field`` (the learned position table's size, or None), and
    define ``build``, ``forward`` and ``attention_shape``. A model whose embedding makes the
    sequence from another input (a ViT's pixels, planned 'patch_embedding') defines
    ``own_sequence_length``; one whose head reads one token per sequence (a classifier on the
    cls token, planned 'first_token') sets ``pooled_head``."""

    plan: dict[str, str] = {}
    layers_field = "num_hidden_layers"
    positions_field: str | None = "max_position_embeddings"
    pooled_head = False  # True: outputs and targets [B], one per sequence, the same on every sp rank

    def __init__(self, config, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, sequence_parallel: bool = True, device=None, seed: int | None = None):
        super().__init__()
        hidden, heads = self.attention_shape(config)
        check_heads(self.family, hidden, heads, mesh, sp_mode)
        self.config, self.mesh, self.checkpointing, self.sp_mode = config, mesh, checkpointing, sp_mode
        blocks, self.is_first, self.is_last = common.stage_blocks(self.family, getattr(config, self.layers_field),
                                                                 stage, stage_layers)
        self.stage_index = stage[0] if stage is not None else 0  # its global stage (shardzoo.pipeline)
        with torch.device("meta"):  # shapes only: the engine builds this rank's pieces from them
            self.build(config, blocks)
        self.stage_state = split_stage(self, mesh, self.plan, sp_mode=sp_mode, causal=self.causal,
                                       checkpointing=checkpointing,
                                       sequence_parallel=sequence_parallel and stage is None)
        tokens = self.own_sequence_length(config)
        if tokens is not None and mesh.sp_size > 1 and not self.is_first:
            # the first stage's 'patch_embedding' masks the sequence padding; the others do it here
            state = self.stage_state
            self.register_forward_pre_hook(lambda m, a: mask_padding(state, tokens, a[0].shape[0], a[0].device))
        layout = layout_of(mesh)
        self.placement = layout.activation
        if self.is_last:  # without a head the last stage returns hidden states in the activation placement
            head = self.head_name
            self.target_placement = layout.after(self.get_submodule(head)) if head is not None else self.placement
        self.allocate(device, seed)

    @classmethod
    def serial_model(cls, config) -> "PlannedModel":
        """The whole model as plain modules on the meta device, unsplit and holding no weights:
        what ``shardzoo plan`` walks with ``plan`` (planner/walk.py). Its forward takes
        :meth:`example_input`."""
        model = cls.__new__(cls)
        StagedModel.__init__(model)
        model.config, model.is_first, model.is_last = config, True, True
        with torch.device("meta"):
            model.build(config, range(getattr(config, cls.layers_field)))
        return model

    @classmethod
    def example_input(cls, config, rows: int, tokens: int) -> torch.Tensor:
        """A first stage's input of ``rows`` sequences (of ``tokens`` tokens where the input is
        the token sequence): ids [rows, tokens]; a model making its own sequence overrides it."""
        return torch.zeros(rows, tokens, dtype=torch.long)

    @staticmethod
    def attention_shape(config) -> tuple[int, int]:
        """(hidden size, attention heads) of ``config``."""
        return config.hidden_size, config.num_attention_heads

    @staticmethod
    def own_sequence_length(config) -> int | None:
        """Tokens of the sequence the first stage's embedding makes from the input (a ViT: cls +
        patches), padded over sp to a multiple of sp (the padding masked out of attention on
        every stage); None: the input is the token sequence."""
        return None

    def build(self, config, blocks: range) -> None:
        raise NotImplementedError

    def gather_rows(self, y_local: torch.Tensor) -> torch.Tensor:
        """One vector per row in the activation placement (a pooled output), [b, H_l] -> [B, H]
        on every rank."""
        return self.layout.gather_hidden(y_local, self.placement)

    def shard_input(self, ids_full: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] -> this rank's [b, s] (batch as the tp layout, sequence over sp);
        raises when S exceeds the learned position table. A model making its own sequence
        takes its input (pixels [B, C, img, img]) split along the batch only, the same on every
        tp and sp rank of a dp replica (checked with ``SHARDZOO_DEBUG=1``)."""
        if self.own_sequence_length(self.config) is not None:
            if replicas.debug_mode():
                replicas.check_same_input(ids_full, self.mesh, f"{type(self).__name__}.shard_input")
            return self.layout.shard_batch(ids_full, self.placement)
        if self.positions_field is not None and ids_full.dim() == 2:
            common.check_seq_len(self.family, ids_full.shape[1], getattr(self.config, self.positions_field),
                                 self.positions_field)
        return super().shard_input(ids_full)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """This stage's output -> the full tensor on every rank (pipeline.StagedModel); hidden
        states of a model making its own sequence lose the sp padding: [B, T, H]."""
        y = super().gather_output(y_local)
        tokens = self.own_sequence_length(self.config)
        if tokens is None or (self.is_last and self.head_name is not None):
            return y
        return y[:, :tokens]

    @property
    def target_axes(self) -> tuple[str, ...]:
        """dp, sp and the head's batch axes (loss.GlobalLoss); a pooled head's targets are the
        same on every sp rank (its token is broadcast over sp), so not split over sp."""
        if self.pooled_head:
            return ("dp",) + tuple(getattr(self.target_placement, "batch_axes", ()))
        return super().target_axes

    def per_target_loss(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        label_smoothing: float) -> torch.Tensor:
        """Per-target cross entropy shaped like ``target``: the head's own (vocabulary-parallel)
        loss, or for a head with full logits [b, ..., C] (a 'classifier') torch's."""
        head = self.get_submodule(self.head_name)
        if hasattr(head, "loss"):
            return super().per_target_loss(logits, target, ignore_index, label_smoothing)
        losses = F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, reduction="none")
        return losses.view(target.shape)
