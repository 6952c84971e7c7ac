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

from shardzoo.layers.attention import check_heads
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.models import common
from shardzoo.models.pipeline import StagedModel
from shardzoo.parallel.stage import split_stage


class PlannedModel(StagedModel):
    """A family model on ``mesh``; ``stage=(k, n)`` / ``stage_layers`` build one pipeline stage.

    Args:
        config: the family's config dataclass. mesh: ParallelMesh (tp in any mode, sp, dp, pp).
        stage, stage_layers: pipeline stage (models/common.stage_blocks); None: whole model.
        sp_mode: "ring" or "ulysses" attention over sp. checkpointing: recompute each block
            in backward (activation checkpointing).
        device: of the parameters ("meta": shapes only). seed: of the init (default
            ``torch.initial_seed()``).

    Subclasses set ``family``, ``causal``, ``plan``, ``layers_field`` (the config field
    counting blocks) and ``positions_field`` (the learned position table's size, or None), and
    define ``build``, ``forward`` and ``attention_shape``."""

    plan: dict[str, str] = {}
    layers_field = "num_hidden_layers"
    positions_field: str | None = "max_position_embeddings"

    def __init__(self, config, *, mesh, stage=None, stage_layers=None, sp_mode: str = "ring",
                 checkpointing: bool = False, device=None, seed: int | None = None):
        super().__init__()
        hidden, heads = self.attention_shape(config)
        check_heads(self.family, hidden, heads, mesh, sp_mode)
        self.config, self.mesh, self.checkpointing, self.sp_mode = config, mesh, checkpointing, sp_mode
        blocks, self.is_first, self.is_last = common.stage_blocks(self.family, getattr(config, self.layers_field),
                                                                 stage, stage_layers)
        with torch.device("meta"):  # shapes only: the engine builds this rank's pieces from them
            self.build(config, blocks)
        self.stage_state = split_stage(self, mesh, self.plan, sp_mode=sp_mode, causal=self.causal,
                                       checkpointing=checkpointing)
        tpl = layout_of(mesh)
        self.layout = tpl.activation
        if self.is_last and self.head_name is not None:
            self.target_layout = tpl.after(self.get_submodule(self.head_name))
        self.allocate(device, seed)

    @staticmethod
    def attention_shape(config) -> tuple[int, int]:
        """(hidden size, attention heads) of ``config``."""
        return config.hidden_size, config.num_attention_heads

    def build(self, config, blocks: range) -> None:
        raise NotImplementedError

    def shard_input(self, ids_full: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] -> this rank's [b, s] (batch as the tp layout, sequence over sp);
        raises when S exceeds the learned position table."""
        if self.positions_field is not None and ids_full.dim() == 2:
            common.check_seq_len(self.family, ids_full.shape[1], getattr(self.config, self.positions_field),
                                 self.positions_field)
        return super().shard_input(ids_full)
