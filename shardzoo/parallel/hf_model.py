"""What ``parallelize`` needs from a transformers model, through transformers' own extension
points only: its plan (``tp_plan`` / ``base_model_tp_plan``), its head counts (the config),
its loss (``loss_function``) and its attention (``AttentionInterface``, hf_attention.py).
transformers stays optional: a plain ``nn.Module`` never imports it.
"""

from __future__ import annotations

import functools
import re
import sys

import torch
from torch import nn

from shardzoo.layers import batch_loss
from shardzoo.parallel import generation, hf_attention, inputs, router_logits
from shardzoo.parallel.kinds import is_norm
from shardzoo.parallel.plan import matches, style_of


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``. An instance of its classes means
    transformers is imported already, so it is looked up, never imported here: importing it
    would add tens of MiB to every rank that splits a model of its own."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def is_causal_lm(model: nn.Module) -> bool:
    """A causal LM (its labels are shifted): transformers' ``*ForCausalLM`` / ``*LMHeadModel``."""
    name = type(model).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel")) or getattr(model, "loss_type", None) == "ForCausalLM"


def config_heads(model: nn.Module) -> tuple[int, int, int] | None:
    """(heads, kv heads, head_dim) from a transformers config, or None."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    return heads, kv, head_dim


# plans shardzoo ships for transformers classes that have none (matched by class name, also on
# subclasses); completed like the others
SHIPPED_PLANS = {
    "GPT2Model": {
        "wte": "vocab_embedding", "wpe": "embedding", "h.*.ln_1": "norm", "h.*.ln_2": "norm", "ln_f": "norm",
        "h.*.attn.c_attn": "packed_column", "h.*.attn.c_proj": "row", "h.*.mlp.c_fc": "column",
        "h.*.mlp.c_proj": "row",
    },
}


def _shipped(model: nn.Module) -> dict[str, str]:
    for cls in type(model).__mro__:
        if cls.__name__ in SHIPPED_PLANS:
            return dict(SHIPPED_PLANS[cls.__name__])
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        return _shipped(base)
    return {}


def default_plan(model: nn.Module) -> dict[str, str] | None:
    """A transformers model's own plan (the instance's ``tp_plan``, else the config's
    ``base_model_tp_plan`` and the class's ``_tp_plan``) with its ``base_model_ep_plan`` (a MoE
    model's experts: style 'experts'), completed with the token embedding, the output head,
    every norm over the hidden size and every norm over a whole projection's output
    ('column_norm', :func:`_full_width_norms`). None for a model without one."""
    if not is_transformers_model(model):
        return None
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    if not plan:
        plan = _shipped(model)
    if not plan:
        return None
    plan.update(_full_width_norms(model, plan))
    # the experts of a MoE model: its ep plan's entries take the experts' modules from the tp plan
    ep_plan = dict(getattr(model.config, "base_model_ep_plan", None) or {})
    if ep_plan:
        plan = {p: s for p, s in plan.items() if not any(p == e or p.startswith(e + ".") for e in ep_plan)}
        # a MoE model's tp plan names the dense MLPs of the layers that have one (Qwen3-MoE's
        # mlp_only_layers); with none, those entries match nothing and are dropped
        names = [n for n, _ in model.named_modules() if n]
        plan = {p: s for p, s in plan.items() if any(matches(p, n) for n in names)}
        ep_plan = {p: s for p, s in ep_plan.items() if any(matches(p.rpartition(".")[0] if s == "grouped_gemm" else p, n)
                                                          for n in names)}
        # the routers the model records router logits from, and shared experts, where its plans
        # leave them out
        ep_plan.update({p: "router" for p in _router_patterns(model) if style_of({**plan, **ep_plan}, p) is None})
        ep_plan.update({p: s for p, s in _shared_expert_entries(model).items() if style_of({**plan, **ep_plan}, p) is None})
    return complete_plan(model, {**plan, **ep_plan})


# transformers' styles that gather a column layer's output for a norm over its whole width, and
# split the gathered attention output again: what a norm over the split width replaces
_GATHERED = {"colwise_gather_output": "column", "rowwise_split_input": "row"}


def _full_width_norms(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Plan entries for the norms over the whole output of the projection they are named after
    (OLMoE's ``q_norm`` / ``k_norm`` over every head of ``q_proj`` / ``k_proj``): 'column_norm'
    (split over tp with that output, statistics all-reduced), and for the projections beside
    them that the model's plan gathers for such a norm (``colwise_gather_output``, then
    ``rowwise_split_input``), 'column' / 'row', so the attention stays split over its heads.
    Block indices as '*'; a per-head norm (Qwen3's) is left to the plan."""
    entries: dict[str, str] = {}
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        weight = getattr(module, "weight", None)
        if not is_norm(module) or not leaf.endswith("_norm") or weight is None or weight.dim() != 1:
            continue
        holder = model.get_submodule(parent) if parent else model
        proj = getattr(holder, leaf[:-len("_norm")] + "_proj", None)
        if not isinstance(proj, nn.Linear) or proj.out_features != weight.shape[0]:
            continue
        entries[_wild(name)] = "column_norm"
        siblings = [f"{parent}.{child}" for child, _ in holder.named_children()]
        entries.update({p: _GATHERED[s] for p, s in plan.items()
                        if s in _GATHERED and any(matches(p, n) for n in siblings)})
    return entries


def _shared_expert_entries(model: nn.Module) -> dict[str, str]:
    """Plan entries for what a MoE block (the parent of a module with the experts contract)
    holds beside its experts and router: a dense MLP (``gate_proj`` / ``up_proj`` / ``down_proj``
    linears: Qwen2-MoE's shared expert) as a column / column / row pair, and a linear onto one
    output (its per-token sigmoid gate) as a 'router' (whole; on sequence chunks its gradient
    summed over tp). Block indices as '*'."""
    from shardzoo.layers.experts import is_experts

    entries: dict[str, str] = {}
    for name, module in model.named_modules():
        if not is_experts(module) or "." not in name:
            continue
        block = name.rpartition(".")[0]
        for child_name, child in model.get_submodule(block).named_children():
            where = _wild(f"{block}.{child_name}")
            parts = [getattr(child, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            if all(isinstance(p, nn.Linear) for p in parts):
                entries.update({f"{where}.gate_proj": "column", f"{where}.up_proj": "column",
                                f"{where}.down_proj": "row"})
            elif isinstance(child, nn.Linear) and child.out_features == 1:
                entries[where] = "router"
    return entries


def _wild(name: str) -> str:
    """A module name with its block indices as '*' (a plan pattern for every block)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _router_patterns(model: nn.Module) -> list[str]:
    """The names of a transformers MoE model's routers (the modules its ``_can_record_outputs``
    records ``router_logits`` from), block indices as '*'."""
    spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(spec, "target_class", None)
    if not isinstance(target, type):
        return []
    names = [n for n, m in model.named_modules() if isinstance(m, target)]
    return list(dict.fromkeys(_wild(n) for n in names))


def complete_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` plus what a transformers plan leaves replicated but a layout splits: the input
    embedding ('vocab_embedding'), the output embedding ('lm_head'), every LayerNorm /
    RMSNorm over the hidden size ('norm') and every nn.Dropout ('dropout': the layout's masks);
    entries the plan has already win."""
    names = {id(m): n for n, m in model.named_modules()}
    extra: dict[str, str] = {}
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inp is not None and id(inp) in names:
        extra[names[id(inp)]] = "vocab_embedding"
    if out is not None and id(out) in names:
        extra[names[id(out)]] = "lm_head"
    hidden = getattr(model.config, "hidden_size", None)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if is_norm(module) and weight is not None and weight.shape[0] == hidden:
            extra[name] = "norm"
        elif isinstance(module, nn.Dropout):
            extra[name] = "dropout"
    complete = dict(plan)
    for name, style in extra.items():
        found = style_of(plan, name)
        if found is None or (style == "norm" and found[0] in ("replicate", "replicate_sum")):
            complete[name] = style
    return complete


def install(model: nn.Module, state: inputs.Parallelized) -> None:
    """The global-mean vocab-parallel loss as the model's ``loss_function``, with sp > 1
    shardzoo's ring / Ulysses attention as its attention implementation, and a ``generate``
    that reads whole logits (generation.py)."""
    if state.head is not None:
        model.loss_function = functools.partial(_loss, state, model)
    if state.mesh.sp_size > 1:
        hf_attention.use_sequence_parallel_attention(model, state)
    # a MoE causal LM's router logits and aux loss under sp / Megatron sequence parallelism: the
    # serial ones over the replica's whole sequences
    router_logits.install(model, state, is_causal_lm(model))
    generation.install(model, state)  # generate reads whole logits; refused under sp


def _loss(state, model, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
          **kwargs):
    # labels are this rank's targets already (inputs.shard_labels, in the forward pre-hook);
    # the logits are upcast as transformers' own causal-LM loss does
    num_targets = _step_targets(state, num_items_in_batch)
    return inputs.local_loss(state, model, logits.float(), labels, ignore_index=ignore_index, num_targets=num_targets)


def _step_targets(state, num_items_in_batch):
    """The step's real targets over every replica, to divide the loss by: ``num_targets=`` of
    the forward (the whole step's, e.g. ``model.count_targets``), or transformers' own
    ``num_items_in_batch=`` as its Trainer passes it (this dp replica's real targets over the
    step's micro-batches; every tp and sp rank of the replica holds the same count), summed
    over dp here; None: this call's own count."""
    if num_items_in_batch is None:
        return state.num_targets
    if state.num_targets is not None:
        raise ValueError(f"pass either num_targets={state.num_targets} (the whole step's real targets, e.g. "
                         f"model.count_targets) or num_items_in_batch={num_items_in_batch} (this dp replica's), not both")
    mesh = state.mesh
    count = torch.as_tensor(num_items_in_batch, dtype=torch.float64).reshape(1)
    if mesh.device_mesh.device_type == "cuda":  # NCCL reduces CUDA tensors only
        count = count.cuda()
    return batch_loss.sum_over_axes(count, mesh, ("dp",)).reshape(())
