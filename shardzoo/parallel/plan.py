"""Plans: which module of a model becomes which parallel block.

A plan maps fnmatch patterns over qualified module names to a style. A pattern matches a name
when it matches the whole name or a tail of it that starts after a dot, so transformers' base
model plans (``layers.*.self_attn.q_proj``) match ``model.layers.0.self_attn.q_proj`` of the
causal-LM wrapper; the longest matching pattern wins (the fewest wildcards among equals). Styles (docs/parallelize.md):

================== ==================================================================
column             first of a pair (nn.Linear): output features split over the head axis
row                second of a pair: input features split, output in the block's layout
norm               LayerNorm / RMSNorm over the hidden size, in the layout's split
vocab_embedding    token table split along the vocabulary (and the hidden in the grids)
embedding          small table (positions) whose output follows the activation layout
position_embedding an nn.Embedding indexed by token positions 0..S-1 computed from the
                   local length: under sp each index becomes this rank's global position
                   (plus the table's ``offset`` attribute, OPT's row of position 0)
lm_head            vocabulary-parallel output projection (tied to the token table if the
                   model ties them)
replicate          the module stays whole on every rank
packed_column      a column layer whose output packs equal parts (GPT-2's q|k|v c_attn,
                   a fused gate|up): each part split like a column layer's
head_fused_column  a column layer whose output rows are grouped by head, each head's
                   parts together (Megatron's fused QKV: head, q|k|v, head_dim), so
                   any contiguous split holds whole heads: split as a column layer
dense              an nn.Linear whose output stays in the layout of its input (a pooler, an
                   MLM transform, a projection between widths): replicated in 1d
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
================== ==================================================================

Linear styles take an ``nn.Linear`` or transformers' ``Conv1D`` (weight stored [in, out]).

transformers' names are accepted too (``colwise``, ``rowwise``, ``colwise_gather_output``,
``replicated_with_grad_allreduce``, ...). ``replicated_with_grad_allreduce`` is a replicated
module that sees a different part of the data on each tp rank (Qwen3's per-head q_norm), so its
gradient is summed over tp; it is style ``replicate_sum`` here.
"""

from __future__ import annotations

import fnmatch

from torch import nn

STYLES = ("column", "row", "norm", "vocab_embedding", "embedding", "position_embedding", "lm_head", "replicate",
          "replicate_sum", "packed_column", "head_fused_column", "dense", "first_token", "dropout",
          "patch_embedding", "classifier", "vocab_bias")

ALIASES = {
    "colwise": "column", "local_colwise": "column", "colwise_rep": "column", "packed_colwise": "packed_column",
    "rowwise": "row", "local_rowwise": "row", "rowwise_rep": "row", "rowwise_split_input": "row",
    "colwise_gather_output": "lm_head", "vocab_parallel": "vocab_embedding", "embedding_rowwise": "vocab_embedding",
    "sequence_parallel": "norm", "layernorm": "norm", "rmsnorm": "norm",
    "replicated": "replicate", "local": "replicate", "replicated_with_grad_allreduce": "replicate_sum",
}


def canonical_style(style: str, where: str) -> str:
    """``style`` (ours or transformers') as one of :data:`STYLES`; raises naming the fix."""
    if not isinstance(style, str):
        raise TypeError(f"plan entry {where!r}: the style must be a string, got {style!r}")
    name = ALIASES.get(style, style)
    if name not in STYLES:
        ours = ", ".join(s for s in STYLES if s != "replicate_sum")
        raise ValueError(f"plan entry {where!r}: style {style!r} is not one shardzoo builds; use one of {ours} (or "
                         f"transformers' colwise, rowwise, colwise_gather_output, replicated_with_grad_allreduce)")
    return name


def matches(pattern: str, name: str) -> bool:
    """True when ``pattern`` matches qualified module ``name`` whole or from a dot on."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def style_of(plan: dict[str, str], name: str) -> tuple[str, str] | None:
    """(style, pattern) of the longest pattern of ``plan`` matching ``name`` (of equal lengths,
    the one with fewer wildcards), or None."""
    found = [p for p in plan if matches(p, name)]
    if not found:
        return None
    pattern = max(found, key=lambda p: (len(p), -p.count("*") - p.count("?")))
    return canonical_style(plan[pattern], pattern), pattern


def check_plan(plan) -> dict[str, str]:
    """``plan`` as a dict of pattern -> canonical style, every entry checked."""
    if not isinstance(plan, dict):
        raise TypeError(f"a plan is a dict of module-name pattern -> style; got {type(plan).__name__}")
    return {str(p): canonical_style(s, p) for p, s in plan.items()}


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm, torch's or a model's own class of that name."""
    name = type(module).__name__.lower()
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("layernorm", "rmsnorm"))
