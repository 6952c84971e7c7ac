"""A model and its plan as the shape the planner prices (walk.py reads it, walk_pieces.py
prices it): ``shardzoo.plan(walked_model(model, plan), ...)`` for a model ``parallelize``
splits, ``family_shape(spec, config)`` for one of shardzoo's families, whose stage builder
splits the same plain modules by the same plan (any pp)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn

from shardzoo.parallel import hf_model, pipeline_cut

from shardzoo.planner.walk import TRACE_BATCH, TRACE_SEQ, Walk, walk_model
from shardzoo.planner.walk_pieces import check_walk, walk_parts


def _max_positions(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2**62  # no learned or stated limit


@dataclass(frozen=True, eq=False)
class ModelShape:
    """A model and its plan, priced from its modules (``walk``). ``family``: the family's name,
    or the config's ``model_type`` (or the class name); ``name``: the preset or directory, for
    messages."""

    family: str
    config: object
    name: str
    walk: Walk
    tokens: int | None = None  # the sequence the model makes of its input (an image model's patches), or None
    builder: type | None = None  # a family's model class, built stage by stage by its constructor
    cuts: bool = False  # parallelize can cut the model into pipeline stages (it has a pipeline plan)

    @property
    def pipelines(self) -> bool:
        """A family's stage builder makes any pp; ``parallelize`` cuts a model with a pipeline
        plan (parallel/pipeline_cut.py) into any pp."""
        return self.builder is not None or self.cuts

    @property
    def sequence_parallel_stages(self) -> bool:
        """Megatron sequence parallelism across the pipeline stages (``parallelize``'s cut: the
        first stage enters the layout, the last leaves it, the stages send this tp rank's chunk);
        a family's pipeline stage keeps its activations replicated over tp."""
        return self.builder is None

    @property
    def averages_sp_in_backward(self) -> bool:
        """``parallelize`` (a walked model, no family builder) averages every parameter's
        gradient over sp in backward itself (parallel/sp_grads.py), so ``data_parallel``'s DDP
        (ZeRO 0 / 1) reduces over dp only; a family's stages leave sp to ``data_parallel``."""
        return self.builder is None

    @property
    def pooled(self) -> bool:
        """The head reads one token per sequence (its targets are not split over sp)."""
        return any(s.style == "first_token" for s in self.walk.post)

    @property
    def hidden(self) -> int:
        """The width of the blocks' input."""
        return next(s.width for s in self.walk.block if s.width)

    @property
    def n_experts(self) -> int:
        """The experts of each MoE layer of the blocks (the fewest, where layers differ; 0: no
        MoE layer): ep must divide it."""
        from math import gcd

        from shardzoo.planner.experts import experts_shape

        return gcd(*(experts_shape(s.module)[0] for s in self.walk.block if s.style == "experts"))

    @property
    def layers(self) -> int:
        return len(self.walk.blocks)

    @property
    def heads(self) -> int:
        return next(iter(self.walk.attention.values())).heads if self.walk.attention else 0

    @property
    def vocab(self) -> int:
        """The head's vocabulary (0: a classifier)."""
        return next((s.module.out_features for s in self.walk.post if s.style == "lm_head"), 0)

    @property
    def causal(self) -> bool:
        return self.walk.causal

    @property
    def max_seq(self) -> int:
        """The config's positions, and the rows of any table indexed by position (an embedding
        whose ids are one row broadcast over the batch)."""
        tables = [s.module.num_embeddings for s in self.walk.pre
                  if s.style in ("embedding", "position_embedding") and s.lead == 1]
        return min([_max_positions(self.config), *tables])

    @property
    def parameters(self) -> int:
        """Serial parameter elements, each tensor once."""
        return sum(p.numel() for p in {id(p): p for p in self.walk.model.parameters()}.values())

    def check(self, costs, b) -> None:
        check_walk(self, costs, b)

    def parts(self, costs, b):
        return walk_parts(self, costs, b)


def walked_model(model: nn.Module, plan: dict[str, str] | None = None, name: str = "") -> ModelShape:
    """``model`` and its ``plan`` (None: its default plan) as the shape the planner prices:
    ``shardzoo.plan(walked_model(model, plan), ...)``; ``shardzoo.plan(model, ...)`` does this with
    the default plan. Build ``model`` on the meta device (``with torch.device("meta"):``) to hold
    no weights."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None) or type(model).__name__
    return ModelShape(family, config if config is not None else SimpleNamespace(), name or family,
                       walk_model(model, plan), cuts=_has_pipeline_plan(model))


def _has_pipeline_plan(model: nn.Module) -> bool:
    """Whether ``parallelize`` can cut ``model`` into pipeline stages (its pipeline plan names one
    list of blocks)."""
    try:
        pipeline_cut.plan_parts(model, None, hf_model.is_transformers_model(model))
    except ValueError:
        return False
    return True


def family_shape(spec, config, name: str = "") -> ModelShape:
    """One of shardzoo's families (its ``FamilySpec``) with ``config``, walked from its plain
    modules and plan as the stage builder splits them (any pp)."""
    cls = spec.model
    model = cls.serial_model(config)
    walk = walk_model(model, cls.plan, example=cls.example_input(config, TRACE_BATCH, TRACE_SEQ), causal=cls.causal,
                      partial=True)
    return ModelShape(spec.name, config, name or spec.name, walk, tokens=cls.own_sequence_length(config), builder=cls)
