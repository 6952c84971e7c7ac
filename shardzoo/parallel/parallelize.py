"""``parallelize(model, mesh, plan)``: split an existing model into any tp layout, in place.

Every planned module is rebuilt by the mesh's layout object from the serial module
(``layout_of(mesh).linear(serial=...)`` and so on), so parallel init equals serial init and no
layer is written twice. The model's own forward code then runs unchanged on this rank's blocks:
the heads a rank holds are whole, the head counts attention code reads are made local
(heads.py), inputs are split on the way in and the loss is the global token mean (inputs.py),
and sequence parallelism goes through transformers' ``AttentionInterface`` (hf_attention.py)
or, for a module of one's own, through its ``F.scaled_dot_product_attention`` calls
(sdpa_mode.py).
Everything is checked before any weight moves: a plan entry whose module has the wrong type,
an uncovered module holding weights, head counts the layout cannot split.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardzoo.layers.attention_core import SP_MODES
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.parallel import checkpointing as block_checkpointing
from shardzoo.parallel import heads as head_counts
from shardzoo.parallel import hf_model, inputs, linears, megatron_sp, padding, sdpa_mode, sp_grads
from shardzoo.parallel.classifier import build_classifier
from shardzoo.parallel.dense import build_dense
from shardzoo.parallel.dropouts import build_dropout, is_dropout
from shardzoo.parallel.first_token import install_first_token
from shardzoo.parallel.patches import build_patch_embedding, check_patch_embedding
from shardzoo.parallel.plan import check_plan, is_norm, matches, style_of
from shardzoo.parallel.positions import build_position_embedding
from shardzoo.parallel.replicated import sum_grads_over
from shardzoo.parallel.vocab_bias import check_vocab_bias, head_of_bias, install_vocab_bias

KEEPS_CHILDREN = ("first_token", "vocab_bias")  # hooked in place: the plan still covers their children

_STATE = "_shardzoo_parallel"


def is_weighted_kind(module: nn.Module) -> bool:
    """The kinds the layouts split, which must be planned: Linear, Conv1D, Embedding, norms."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D" or is_norm(module)


def state_of(model: nn.Module):
    """The :class:`~shardzoo.parallel.inputs.Parallelized` record of a parallelized model, or None."""
    return model.__dict__.get(_STATE)


def parallelize(model: nn.Module, mesh, plan: dict[str, str] | None = None, *, sp_mode: str = "ring",
                causal: bool | None = None, checkpointing: bool = False, check_inputs: str = "first",
                sequence_parallel: bool = True) -> nn.Module:
    """Split ``model`` over ``mesh``'s tp layout (1d, 2d, 2.5d, 3d) and sp, in place; returns it.

    Args:
        model: a transformers model (its own code runs) or any ``nn.Module``.
        mesh: ParallelMesh (dp, sp, tp in any mode; pp must be 1).
        plan: {module-name pattern: style} (shardzoo/parallel/plan.py); None: the model's own
            (transformers' ``base_model_tp_plan`` + ``_tp_plan`` completed with the norms, the
            token embedding and the head, or a plan shardzoo ships for the class).
        sp_mode: "ring" or "ulysses" attention over sp: transformers' ``AttentionInterface``, or
            every ``F.scaled_dot_product_attention`` call of a module of one's own (sdpa_mode.py).
        causal: whether the model is causal: its labels are shifted (``lm_loss``, transformers'
            ``labels=``) and its sp shards are zigzag. None: a transformers ``*ForCausalLM``
            / ``*LMHeadModel`` is; a module of one's own is unless its ``is_causal`` attribute
            is False.
        checkpointing: recompute each block in backward (activation checkpointing): every
            child of the model's lists of repeated blocks (checkpointing.py), under
            ``torch.utils.checkpoint`` with the SDPA mode and the dropout streams replayed.
        check_inputs: "first" (default), "every" or "never": compare the inputs the tp and sp
            ranks of a dp replica were given (a checksum of the ids, mask, labels and positions,
            one small all-reduce per axis) on the first forward, on every forward, or never;
            different inputs raise, naming the ranks (inputs.py).
        sequence_parallel: Megatron sequence parallelism in 1d with tp > 1 (megatron_sp.py):
            the activations between the blocks are split along the sequence over tp (norms,
            dropout, residual adds on 1/tp of the tokens). False keeps them replicated.

    Afterwards ``model(input_ids=[B, S], attention_mask=[B, S], labels=[B, S], ...)`` takes the
    full tensors of this dp replica on every tp and sp rank; ``out.loss`` is the global token
    mean (the same on every rank) and ``out.logits`` this rank's block, which
    :func:`~shardzoo.parallel.inputs.gather_logits` assembles. After ``out.loss.backward()``
    every gradient is the serial one for this dp replica's rows: summed over tp by the layers
    and over sp by a hook on each parameter (sp_grads.py); ``data_parallel`` adds dp only.
    Collective over the mesh."""
    if state_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is parallelized already (over {state_of(model).mesh!r}); "
                         f"parallelize a fresh model")
    if sp_mode not in SP_MODES:
        raise ValueError(f"parallelize: sp_mode={sp_mode!r} is not one of {SP_MODES}")
    if check_inputs not in inputs.CHECK_INPUTS:
        raise ValueError(f"parallelize: check_inputs={check_inputs!r} is not one of {inputs.CHECK_INPUTS}")
    if mesh.pp_size != 1:
        raise ValueError(f"parallelize builds one pipeline stage holding the whole model; got pp={mesh.pp_size}. "
                         f"Use pp=1 (pipelines of a parallelized transformers model are not built yet: "
                         f"docs/parallelize.md, 'Limits')")
    hf = hf_model.is_transformers_model(model)
    causal = _is_causal(model, hf) if causal is None else bool(causal)
    if plan is None:
        plan = hf_model.default_plan(model)
        if plan is None:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel plan of its own; pass "
                             f"plan={{'<module pattern>': 'column' | 'row' | 'norm' | ...}} (docs/parallelize.md)")
    planned, attention = split_modules(model, mesh, plan, causal=causal, checkpointing=checkpointing,
                                       config_heads=hf_model.config_heads(model),
                                       whole_tables=hf or mesh.sp_size == 1, sequence_parallel=sequence_parallel,
                                       check=lambda planned: _refuse_hf_positions(model, planned, hf, mesh))
    state = inputs.Parallelized(model, mesh, sp_mode, hf, causal=causal, head=_find(planned, "lm_head"),
                                embedding=_find(planned, "vocab_embedding"))
    state.check_inputs = check_inputs
    model.__dict__[_STATE] = state
    if hf:
        hf_model.install(model, state)  # loss function, sp attention (before the attention configs are copied)
    elif mesh.sp_size > 1:
        sdpa_mode.install(model, state, attention)
    head_counts.make_local(attention)
    inputs.install(model, state)
    sp_grads.install(model, mesh)  # the sp ranks' gradients averaged by backward() itself
    install_checkpointing(model, state, checkpointing)
    return model


def split_modules(model: nn.Module, mesh, plan: dict[str, str], *, causal: bool, checkpointing: bool = False,
                  config_heads=None, check=None, partial: bool = False,
                  whole_tables: bool = False, sequence_parallel: bool = True) -> tuple[dict, dict]:
    """Replace every module ``plan`` covers by the mesh's layout block, in place, after checking
    all of them (nothing changes when a check fails); the engine step both ``parallelize`` and
    the model families' stage builder (models/pipeline.py) take. ``check(planned)``: a further
    check before anything moves. ``partial``: the model is one pipeline stage of a model the plan
    describes, so entries matching no module here are fine. ``whole_tables``: in 1d an
    ``nn.Embedding`` the plan does not cover is kept whole (its indices are whole on every tp
    rank) instead of refused. ``sequence_parallel``: Megatron sequence parallelism between the
    blocks in 1d (megatron_sp.py). Returns ({name: (serial module, style, pattern)}, the
    attention modules (heads.py), whose head counts the caller makes local once its hooks
    that read the global counts are installed)."""
    plan = check_plan(plan)
    tpl = layout_of(mesh)
    planned = _planned_modules(model, plan, partial)
    _refuse_uncovered(model, planned, tpl, whole_tables)
    if checkpointing:
        block_checkpointing.block_names(model)  # raises when there are no blocks
    if check is not None:
        check(planned)
    megatron_sp.check(model, planned, tpl, sequence_parallel)
    attention = head_counts.attention_modules(model, planned, tpl, config_heads)
    built = _build(model, planned, tpl, attention, zigzag=causal)  # nothing in the model has changed so far
    for name, new in built.items():
        model.set_submodule(name, new)
    for name, (module, style, _) in planned.items():
        if style == "replicate_sum":
            sum_grads_over(module, mesh.tp_group)
        elif style == "first_token":
            install_first_token(module, tpl)
        elif style == "vocab_bias":  # the built head: the bias is split like its logits
            install_vocab_bias(module, model.get_submodule(head_of_bias(name, module, planned)), tpl)
    megatron_sp.install(model, planned, tpl, sequence_parallel)
    return planned, attention


def install_checkpointing(model: nn.Module, state, checkpointing: bool) -> None:
    """Recompute each block of ``model`` in backward when ``checkpointing`` (checkpointing.py)."""
    if checkpointing:
        for name in block_checkpointing.block_names(model):
            block_checkpointing.install(model.get_submodule(name), model, state)


def _is_causal(model: nn.Module, hf: bool) -> bool:
    if hf:
        return hf_model.is_causal_lm(model)
    flag = getattr(model, "is_causal", None)
    return flag if isinstance(flag, bool) else True


def _refuse_hf_positions(model: nn.Module, planned: dict, hf: bool, mesh) -> None:
    """A transformers model under sp gets global ``position_ids`` from the input hook, which a
    'position_embedding' would map a second time."""
    names = [n for n, (_, s, _) in planned.items() if s == "position_embedding"]
    if hf and mesh.sp_size > 1 and names:
        raise ValueError(f"{names[0]} is planned 'position_embedding', but {type(model).__name__} is a transformers "
                         f"model, whose position_ids the input hook already makes global under sp; plan it "
                         f"'embedding'")


def _find(planned: dict, style: str) -> str | None:
    names = [n for n, (_, s, _) in planned.items() if s == style]
    return names[0] if len(names) == 1 else None


def _planned_modules(model: nn.Module, plan: dict[str, str],
                     partial: bool = False) -> dict[str, tuple[nn.Module, str, str]]:
    """{qualified name: (module, style, pattern)} of every module a plan entry covers, the
    type of each checked against its style."""
    planned = {}
    for name, module in model.named_modules():
        if not name:
            continue
        found = style_of(plan, name)
        if found is None:
            continue
        style, pattern = found
        _check_kind(name, module, style, pattern)
        planned[name] = (module, style, pattern)
    names = [name for name, _ in model.named_modules() if name]
    unused = [p for p in plan if not any(matches(p, name) for name in names)]  # overridden everywhere is fine
    if unused and not partial:
        raise ValueError(f"plan entries {unused} match no module of {type(model).__name__}; fix the pattern (module "
                         f"names look like {_example_names(model)})")
    return planned


def _example_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and is_weighted_kind(m)][:4]


def _check_kind(name: str, module: nn.Module, style: str, pattern: str) -> None:
    if style in ("column", "row", "packed_column", "head_fused_column", "dense"):
        if not (isinstance(module, nn.Linear) or linears.is_conv1d(module)):
            raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a {style!r} block, which "
                             f"needs an nn.Linear or a Conv1D; change the style or the pattern")
        return
    if style == "patch_embedding":
        return check_patch_embedding(name, module, pattern)
    want = {"lm_head": nn.Linear, "classifier": nn.Linear, "vocab_embedding": nn.Embedding, "embedding": nn.Embedding,
            "position_embedding": nn.Embedding}.get(style)
    if want is not None and not isinstance(module, want):
        raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a {style!r} block, which "
                         f"needs an nn.{want.__name__}; change the style or the pattern")
    if style == "vocab_bias":
        check_vocab_bias(name, module, pattern)
    if style == "dropout" and not isinstance(module, nn.Dropout):
        raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a 'dropout', which needs an "
                         f"nn.Dropout (elementwise); change the style or the pattern")
    if style == "norm" and not is_norm(module):
        raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a 'norm', which needs a "
                         f"LayerNorm or RMSNorm; change the style or the pattern")


def _refuse_uncovered(model: nn.Module, planned: dict, tpl, whole_tables: bool = False) -> None:
    """Every Linear, Conv1D, Embedding or norm (and, in the grid layouts, any module holding
    weights) must be covered by the plan: its input is split by the layout. With tp > 1 so
    must every dropout module with p > 0 (_refuse_dropout). ``whole_tables``: except, in 1d,
    an ``nn.Embedding``: it reads integer indices, which 1d never splits over tp, so kept
    whole it computes what it computes serially (as transformers keeps an unplanned one).
    Under sp that holds for a transformers model, whose ``position_ids`` the input hook makes
    global, not for a table of one's own that may be indexed by local positions."""
    covered = tuple(f"{n}." for n, (_, style, _) in planned.items() if style not in KEEPS_CHILDREN)
    for name, module in model.named_modules():
        if not name or name in planned or name.startswith(covered):
            continue
        _refuse_dropout(name, module, tpl)
        if tpl.mode == "1d" and isinstance(module, nn.Embedding):
            if whole_tables:
                continue
            if tpl.mesh.sp_size > 1:
                raise ValueError(f"{name} (Embedding) is not in the plan; under sp={tpl.mesh.sp_size} a table of a "
                                 f"module of one's own may be indexed by local positions 0..S/sp-1; plan it: "
                                 f"plan[{name!r}] = 'position_embedding' (positions), or 'vocab_embedding' / "
                                 f"'replicate' (token ids)")
        holds_weights = next(module.parameters(recurse=False), None) is not None
        if is_weighted_kind(module) or (holds_weights and tpl.mode != "1d"):
            kind = type(module).__name__
            raise ValueError(f"{name} ({kind}) is not in the plan, and the {tpl.mode} layout splits the activations "
                             f"it reads; add it to the plan: plan[{name!r}] = 'column' / 'row' / 'norm' / "
                             f"'embedding' ..., or 'replicate' to keep it whole on every rank")


def _refuse_dropout(name: str, module: nn.Module, tpl) -> None:
    """torch's own dropout draws from each rank's generator with nothing keeping the tp ranks'
    draws equal, so a replicated activation could get other masks on other tp ranks and the
    replicas drift apart without an error. A p = 0 dropout draws nothing and is left alone."""
    if tpl.mesh.tp_size == 1 or not is_dropout(module) or getattr(module, "p", 0.0) == 0.0:
        return
    kind = type(module).__name__
    fix = (f"plan it \"dropout\": plan[{name!r}] = 'dropout' (the layout's dropout: one mask on every tp rank where "
           f"the activation is replicated)") if isinstance(module, nn.Dropout) else \
        f"replace it by an nn.Dropout planned 'dropout', or plan it 'replicate' to keep torch's own draws"
    raise ValueError(f"{name} ({kind}, p={module.p}) is not in the plan; under tp={tpl.mesh.tp_size} its masks are "
                     f"drawn by each rank alone and can differ between tp ranks holding the same activation; {fix}")


def _build(model: nn.Module, planned: dict, tpl, attention, zigzag: bool) -> dict[str, nn.Module]:
    """The parallel module for every planned module (embeddings first: a tied head needs them),
    on the device of the serial module (the meta device while ``from_pretrained`` builds).
    ``zigzag``: the sp shards are zigzag (a causal model), for 'position_embedding'."""
    built: dict[str, nn.Module] = {}
    order = sorted(planned, key=lambda n: planned[n][1] != "vocab_embedding")
    for name in order:
        try:
            _build_one(model, name, planned, built, tpl, attention, zigzag)
        except ValueError as err:  # a layer's size rule: say which module broke it
            if name in str(err):
                raise
            raise ValueError(f"{name} ({type(planned[name][0]).__name__}): {err}") from err
    return built


def _build_one(model: nn.Module, name: str, planned: dict, built: dict, tpl, attention, zigzag: bool) -> None:
    """Build ``planned[name]``'s parallel module into ``built`` (replicated styles: nothing)."""
    module, style, _ = planned[name]
    if style in ("replicate", "replicate_sum", *KEEPS_CHILDREN):
        if style == "vocab_bias":
            head_of_bias(name, module, planned)  # raises before anything moves
        return
    if style == "lm_head":
        built[name] = _lm_head(name, module, planned, built, tpl)
    elif style in ("column", "row", "packed_column", "head_fused_column"):
        built[name] = _linear(name, module, style, tpl, attention)
    elif style == "norm":
        built[name] = _norm(name, module, tpl)
    elif style == "vocab_embedding":
        built[name] = tpl.vocab_embedding(serial=module, device=module.weight.device)
    elif style == "position_embedding":
        built[name] = build_position_embedding(module, tpl, zigzag, name)
    elif style == "dropout":
        built[name] = build_dropout(module, tpl.mesh)
    elif style == "dense":
        built[name] = build_dense(module, tpl)
    elif style == "patch_embedding":
        built[name] = build_patch_embedding(module, tpl, model, zigzag)
    elif style == "classifier":
        built[name] = build_classifier(module, tpl)
    else:
        built[name] = tpl.embedding(serial=module, device=module.weight.device)


def _linear(name: str, module: nn.Module, style: str, tpl, attention) -> nn.Module:
    owner = next((a for a in attention.values() if name in a.kv_projections or name in a.packed), None)
    if style == "head_fused_column":  # whole heads in every contiguous split: a column layer
        return linears.build_linear(module, "column", tpl)
    if style == "packed_column":
        return linears.build_packed(module, owner.packed[name] if owner is not None else 2, tpl)
    if owner is not None and name in owner.kv_projections and owner.replicated_kv:
        return linears.build_repeated_kv(name, module, style, tpl, owner)
    serial = linears.serial_linear(module)
    padding.check_hidden(name, serial, style, tpl)
    if padding.inner_width(serial, style) % tpl.column_blocks():  # an MLP's intermediate: zero padding is exact
        layer = padding.build_padded(serial, style, tpl)
        if linears.is_conv1d(module):
            linears.as_conv1d_storage(layer)
        return layer
    return linears.build_linear(module, style, tpl)


def _lm_head(name: str, module: nn.Linear, planned: dict, built: dict, tpl) -> nn.Module:
    tied = [n for n, (m, s, _) in planned.items() if s == "vocab_embedding" and m.weight is module.weight]
    if tied:
        return tpl.lm_head(module.in_features, module.out_features, tie_to=built[tied[0]])
    if any(module.weight is m.weight for m, _, _ in planned.values() if m is not module and hasattr(m, "weight")):
        raise ValueError(f"{name} shares its weight with a module that is not a 'vocab_embedding' in the plan; plan "
                         f"the token table as 'vocab_embedding' so the head can tie to it")
    return tpl.lm_head(serial=module, device=module.weight.device)


def _norm(name: str, module: nn.Module, tpl) -> nn.Module:
    """The layout's LayerNorm / RMSNorm from ``module``, after checking on a random input that
    the plain norm computes what ``module`` computes (a norm of another formula, such as
    ``x * (1 + w)``, is refused rather than replaced by a wrong one)."""
    plain = _plain_norm(name, module)
    _check_plain(name, module)
    build = tpl.norm if isinstance(plain, nn.LayerNorm) else tpl.rms_norm
    return build(serial=plain, device=plain.weight.device if plain.weight is not None else None)


def _check_plain(name: str, module: nn.Module) -> None:
    """Raise unless ``module`` equals its plain norm on a random input (with random weights
    when ``module`` is on the meta device: the formula is what is checked).

    The probe runs on a float64 copy of ``module``, whatever the model's dtype: a bf16 norm
    that computes in fp32 and casts back (transformers' LlamaRMSNorm) rounds differently from
    a plain bf16 norm, which is rounding, not another formula. In float64 the two agree to the
    precision the module computes in (at worst fp32 inside), far inside the bound below, while
    a norm of another formula (Gemma's ``x * (1 + w)``) misses it by the size of its weights."""
    if type(module) in (nn.LayerNorm, nn.RMSNorm):  # torch's own, affine or not: plain by definition
        return
    probe_module = copy.deepcopy(module)
    if any(p.is_meta for p in module.parameters()):
        probe_module = probe_module.to_empty(device="cpu")
        with torch.no_grad():
            for p in probe_module.parameters():
                p.normal_()
    probe_module = probe_module.to(torch.float64)
    plain = _plain_norm(name, probe_module)
    weight = plain.weight
    probe = torch.randn(3, plain.normalized_shape[0], dtype=torch.float64, device=weight.device)
    with torch.no_grad():
        ok = torch.allclose(probe_module(probe).double(), plain(probe), rtol=1e-4, atol=1e-5)
    if not ok:
        raise ValueError(f"{name} ({type(module).__name__}) does not compute a plain {type(plain).__name__} "
                         f"(y = norm(x) * weight [+ bias]); shardzoo cannot split it as 'norm'. Plan it as "
                         f"'replicate' in 1d, or write it as nn.{type(plain).__name__}")


def _plain_norm(name: str, module: nn.Module) -> nn.Module:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return module
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{name} ({type(module).__name__}) has no 1-d weight; plan it as 'replicate' or write it "
                         f"as nn.LayerNorm / nn.RMSNorm")
    eps = next((getattr(module, a) for a in ("variance_epsilon", "eps", "epsilon") if hasattr(module, a)), 1e-6)
    bias = getattr(module, "bias", None)
    if "rms" in type(module).__name__.lower():
        plain = nn.RMSNorm(weight.shape[0], eps=eps, dtype=weight.dtype, device=weight.device)
    else:
        plain = nn.LayerNorm(weight.shape[0], eps=eps, bias=bias is not None, dtype=weight.dtype,
                             device=weight.device)
    with torch.no_grad():
        plain.weight.copy_(weight)
        if isinstance(plain, nn.LayerNorm) and bias is not None:
            plain.bias.copy_(bias)
    return plain
