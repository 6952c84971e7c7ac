"""Plans: which module of a model becomes which parallel block.

A plan maps fnmatch patterns over qualified module names to a style. A pattern matches a name
when it matches the whole name or a tail of it that starts after a dot, so transformers' base
model plans (``layers.*.self_attn.q_proj``) match ``model.layers.0.self_attn.q_proj`` of the
causal-LM wrapper; the longest matching pattern wins (the fewest wildcards among equals).
What each style builds is in styles/ (the registry of styles, styles/__init__.py);
transformers' names for them are accepted too (``colwise``, ``rowwise``,
``colwise_gather_output``, ``replicated_with_grad_allreduce``, ...: :data:`ALIASES`).
``replicated_with_grad_allreduce`` is a replicated module that sees a different part of the
data on each tp rank (Qwen3's per-head q_norm), so its gradient is summed over tp; it is style
``replicate_sum`` here. Of transformers' ep plan, ``ep_dispatch_experts`` is style ``experts``,
``ep_router`` (a router computing on every rank's own tokens) ``router``, and
``grouped_gemm`` entries, which name the experts' parameters, are what ``experts`` does to them
(styles/__init__.py ``check_plan``).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from shardzoo.parallel.pipeline_cut import Placeholder

ALIASES = {
    "colwise": "column", "local_colwise": "column", "colwise_rep": "column", "packed_colwise": "packed_column",
    "rowwise": "row", "local_rowwise": "row", "rowwise_rep": "row", "rowwise_split_input": "row",
    "colwise_gather_output": "lm_head", "vocab_parallel": "vocab_embedding", "embedding_rowwise": "vocab_embedding",
    "sequence_parallel": "norm", "layernorm": "norm", "rmsnorm": "norm",
    "replicated": "replicate", "local": "replicate", "replicated_with_grad_allreduce": "replicate_sum",
    "ep_dispatch_experts": "experts", "ep_router": "router",
}


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
    return ALIASES.get(plan[pattern], plan[pattern]), pattern


def planned_modules(model: nn.Module, plan: dict[str, str]) -> dict[str, tuple[nn.Module, str, str]]:
    """{name: (module, style, pattern)} of every module of ``model`` a plan entry covers
    (:func:`style_of`: the longest pattern wins). A completed plan names every norm of a deep
    model, so the patterns without wildcards are looked up by each tail of the name (a plain
    pattern matches exactly the names it equals or ends with after a dot) and only the others
    go through fnmatch."""
    plain = {p for p in plan if not any(ch in p for ch in "*?[")}
    wild = {p: s for p, s in plan.items() if p not in plain}
    out = {}
    for name, module in model.named_modules():
        if not name or isinstance(module, Placeholder):  # another pipeline stage's module
            continue
        parts = name.split(".")
        tails = {".".join(parts[i:]) for i in range(len(parts))} & plain
        found = style_of({p: plan[p] for p in tails} | wild, name)
        if found is not None:
            out[name] = (module, found[0], found[1])
    return out


def unmatched(model: nn.Module, plan: dict[str, str], planned: dict) -> list[str]:
    """The patterns of ``plan`` that match no module of ``model`` (one that every module it
    matches takes from a longer pattern is fine)."""
    winners = {pattern for _, _, pattern in planned.values()}
    names = [n for n, _ in model.named_modules() if n]
    return [p for p in plan if p not in winners and not any(matches(p, n) for n in names)]
