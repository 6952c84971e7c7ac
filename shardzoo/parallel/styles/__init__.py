"""The plan styles: one object per plan word, in one registry (:data:`STYLES`) that
``parallelize`` and the planner both read (docs/design.md, "Adding a style").

================== ==================================================================
column             first of a pair (nn.Linear): output features split over the head axis
row                second of a pair: input features split, output in the block's placement
norm               LayerNorm / RMSNorm over the hidden size, in the layout's split
column_norm        LayerNorm / RMSNorm over the whole output of a column layer (OLMoE's
                   q_norm / k_norm over every head), split like that output (1d: over
                   tp), its statistics all-reduced over the split
vocab_embedding    token table split along the vocabulary (and the hidden in the grids)
embedding          small table (positions) whose output follows the activation placement
position_embedding an nn.Embedding indexed by token positions 0..S-1 computed from the
                   local length: under sp each index becomes this rank's global position
                   (plus the table's ``offset`` attribute, OPT's row of position 0)
lm_head            vocabulary-parallel output projection (tied to the token table if the
                   model ties them)
replicate          the module stays whole on every rank
replicate_sum      whole on every rank, its gradient summed over tp (transformers'
                   ``replicated_with_grad_allreduce``: Qwen3's per-head q_norm)
packed_column      a column layer whose output packs equal parts (GPT-2's q|k|v c_attn,
                   a fused gate|up): each part split like a column layer's
head_fused_column  a column layer whose output rows are grouped by head, each head's
                   parts together (Megatron's fused QKV: head, q|k|v, head_dim), so
                   any contiguous split holds whole heads: split as a column layer
dense              an nn.Linear whose output stays in the placement of its input (a pooler,
                   an MLM transform, a projection between widths): replicated in 1d
first_token        a module reading token 0 of its input (a pooler's ``x[:, 0]``): under
                   sp it gets the global token 0 as [b, 1, ...]; its children are planned
                   as any others
dropout            an nn.Dropout drawing its mask through the layout (the same mask on
                   every tp rank where the activation is replicated, per rank where split)
patch_embedding    a ViTEmbeddings-like module (conv patches, cls token, positions) making
                   the T tokens itself: under sp its output is this rank's chunk of them
                   padded to a multiple of sp, the padding masked out of attention
classifier         an nn.Linear onto a few classes: full logits in every rank's batch rows
vocab_bias         a module whose own ``bias`` [V] its forward adds to an lm_head's logits
                   (BERT's cls.predictions): the bias split like the logits' vocabulary
experts            a module with transformers' experts contract (gate_up_proj [E, 2I, H],
                   down_proj [E, H, I]): E / ep whole experts per rank of the ep group, the
                   routed tokens moved by the dropless all-to-all (layers/experts.py)
router             the router of a MoE block (transformers' ``ep_router``): whole on every
                   rank; on Megatron sequence chunks its gradient is summed over tp
================== ==================================================================

Linear styles take an ``nn.Linear`` or transformers' ``Conv1D`` (weight stored [in, out]).
transformers' names are accepted too (plan.py ``ALIASES``).
"""

from __future__ import annotations

from torch import nn

from shardzoo.parallel.kinds import is_weighted_kind
from shardzoo.parallel.plan import ALIASES, planned_modules, unmatched
from shardzoo.parallel.styles.base import Build, Style
from shardzoo.parallel.styles.experts import Experts, Router
from shardzoo.parallel.styles.embeddings import Embedding, PatchEmbedding, PositionEmbedding, VocabEmbedding
from shardzoo.parallel.styles.linears import Column, Dense, HeadFusedColumn, PackedColumn, Row
from shardzoo.parallel.styles.logits import Classifier, LMHead, VocabBias
from shardzoo.parallel.styles.norms import ColumnNorm, Norm
from shardzoo.parallel.styles.whole import Dropout, FirstToken, Replicate, ReplicateSum

STYLES: dict[str, Style] = {s.name: s for s in (
    Column(), Row(), Norm(), ColumnNorm(), VocabEmbedding(), Embedding(), PositionEmbedding(), LMHead(), Replicate(),
    ReplicateSum(), PackedColumn(), HeadFusedColumn(), Dense(), FirstToken(), Dropout(), PatchEmbedding(),
    Classifier(), VocabBias(), Experts(), Router())}
# transformers' style for a parameter of an experts module (its split over ep), accepted where
# the plan makes the module 'experts' (which splits its parameters so)
WEIGHT_STYLES = {"grouped_gemm": "experts"}

__all__ = ["STYLES", "Build", "Style", "canonical_style", "check_plan", "check_planned", "covered_prefixes", "match_plan"]


def canonical_style(style: str, where: str) -> str:
    """``style`` (ours or transformers') as a key of :data:`STYLES`; raises naming the fix."""
    if not isinstance(style, str):
        raise TypeError(f"plan entry {where!r}: the style must be a string, got {style!r}")
    name = ALIASES.get(style, style)
    if name not in STYLES:
        ours = ", ".join(s for s in STYLES if s != "replicate_sum")
        raise ValueError(f"plan entry {where!r}: style {style!r} is not one shardzoo builds; use one of {ours} (or "
                         f"transformers' colwise, rowwise, colwise_gather_output, replicated_with_grad_allreduce)")
    return name


def check_plan(plan) -> dict[str, str]:
    """``plan`` as a dict of pattern -> canonical style, every entry checked. An entry naming a
    parameter (transformers' ``...experts.gate_up_proj: grouped_gemm``) is dropped where the
    plan gives its module the style that splits it so, and refused elsewhere."""
    if not isinstance(plan, dict):
        raise TypeError(f"a plan is a dict of module-name pattern -> style; got {type(plan).__name__}")
    weights = {str(p): s for p, s in plan.items() if isinstance(s, str) and s in WEIGHT_STYLES}
    checked = {str(p): canonical_style(s, p) for p, s in plan.items() if str(p) not in weights}
    for pattern, style in weights.items():
        owner = pattern.rpartition(".")[0]
        if checked.get(owner) != WEIGHT_STYLES[style]:
            raise ValueError(f"plan entry {pattern!r}: {style!r} splits a parameter of an experts module, but the plan "
                             f"does not make {owner!r} {WEIGHT_STYLES[style]!r}; add plan[{owner!r}] = "
                             f"'{WEIGHT_STYLES[style]}' (transformers' 'ep_dispatch_experts'), or drop the entry")
    return checked


def check_planned(planned: dict[str, tuple[nn.Module, str, str]]) -> None:
    """Each planned module ({name: (module, style, pattern)}) is of a kind its style splits;
    raises at the first that is not (nothing has moved)."""
    for name, (module, style, pattern) in planned.items():
        STYLES[style].check(name, module, pattern)


def covered_prefixes(planned: dict) -> tuple[str, ...]:
    """Name prefixes of the modules inside a planned module (its style builds them whole); the
    modules inside a style that keeps its children are not covered."""
    return tuple(f"{n}." for n, (_, style, _) in planned.items() if not STYLES[style].keeps_children)


def match_plan(model: nn.Module, plan, partial: bool = False) -> dict[str, tuple[nn.Module, str, str]]:
    """{qualified name: (module, style, pattern)} of every module of ``model`` that ``plan``
    covers (plan.py's matching), each checked by its style. ``partial``: the model is one
    pipeline stage of a model the plan describes, so entries matching no module are fine."""
    plan = check_plan(plan)
    planned = planned_modules(model, plan)
    check_planned(planned)
    unused = unmatched(model, plan, planned)
    if unused and not partial:
        names = [n for n, m in model.named_modules() if n and is_weighted_kind(m)][:4]
        raise ValueError(f"plan entries {unused} match no module of {type(model).__name__}; fix the pattern (module "
                         f"names look like {names})")
    return planned
