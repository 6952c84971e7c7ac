"""``parallelize(model, mesh, plan)``: split an existing model into any tp layout, in place.

Match the plan, check every planned module through its style, build each style's layer, put
the layers in place and let each style install its hooks (``split_modules``); then split the
inputs, route attention over sp and checkpoint the blocks. What a plan word builds is its
style's (styles/: one object per word, ``STYLES``), so parallel init equals serial init and no
layer is written twice. The model's own forward code then runs unchanged on this rank's blocks:
the heads a rank holds are whole, the head counts attention code reads are made local
(heads.py), inputs are split on the way in and the loss is the global token mean (inputs.py),
and sequence parallelism goes through transformers' ``AttentionInterface`` (hf_attention.py)
or, for a module of one's own, through its ``F.scaled_dot_product_attention`` calls
(sdpa_mode.py). Everything is checked before any weight moves.
"""

from __future__ import annotations

from torch import nn

from shardzoo.layers.attention_core import SP_MODES
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.parallel import activation_checkpointing
from shardzoo.parallel import heads as head_counts
from shardzoo.parallel import hf_model, inputs, megatron_sp, pipeline_cut, sdpa_mode, sp_grads
from shardzoo.parallel.coverage import refuse_uncovered
from shardzoo.parallel.styles import STYLES, Build, match_plan

_STATE = "_shardzoo_parallel"


def state_of(model: nn.Module):
    """The :class:`~shardzoo.parallel.inputs.Parallelized` record of a parallelized model, or None."""
    return model.__dict__.get(_STATE)


def parallelize(model: nn.Module, mesh, plan: dict[str, str] | None = None, *, stages: list[int] | None = None,
                virtual_stages: int = 1, sp_mode: str = "ring", causal: bool | None = None,
                checkpointing: bool = False, check_inputs: str = "first", sequence_parallel: bool = True,
                placement: str = "loop", pp_plan: dict | None = None) -> nn.Module:
    """Split ``model`` over ``mesh``'s tp layout (1d, 2d, 2.5d, 3d), sp and pp, in place; returns it.

    Args:
        model: a transformers model (its own code runs) or any ``nn.Module``.
        mesh: ParallelMesh (dp, pp, sp, tp in any mode).
        stages: with pp > 1, the blocks of each of the ``pp * virtual_stages`` pipeline stages
            (summing to the model's block count); None: an even split, the first stages taking
            the remainder. The rank keeps its stage(s) only (pipeline_cut.py); run the pipeline
            with :func:`shardzoo.pipeline`.
        virtual_stages: stages per pp rank (2 or more for the interleaved schedules, 2 for zbv).
        placement: "loop" (stage s on pp rank s % pp) or "v" (two stages per rank, ranks
            0..pp-1 then back: the zbv / dualpipev schedules).
        pp_plan: a module of one's own: its modules in forward order, the repeated blocks an
            ``nn.ModuleList`` (transformers' ``base_model_pp_plan`` form); default its ``pp_plan``.
        plan: {module-name pattern: style} (the styles: shardzoo/parallel/styles/); None: the model's own
            (transformers' ``base_model_tp_plan`` + ``_tp_plan`` completed with the norms, the
            token embedding and the head, or a plan shardzoo ships for the class).
        sp_mode: "ring" or "ulysses" attention over sp: transformers' ``AttentionInterface``, or
            every ``F.scaled_dot_product_attention`` call of a module of one's own (sdpa_mode.py).
        causal: whether the model is causal: its labels are shifted (``lm_loss``, transformers'
            ``labels=``) and its sp shards are zigzag. None: a transformers ``*ForCausalLM``
            / ``*LMHeadModel`` is; a module of one's own is unless its ``is_causal`` attribute
            is False.
        checkpointing: recompute each block in backward (activation checkpointing): every
            child of the model's lists of repeated blocks (activation_checkpointing.py), under
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
    if mesh.pp_size == 1 and (virtual_stages != 1 or stages is not None):
        raise ValueError(f"stages={stages} / virtual_stages={virtual_stages} cut a pipeline, but the mesh has pp=1; "
                         f"build the mesh with pp > 1, or leave them out")
    hf = hf_model.is_transformers_model(model)
    causal = _is_causal(model, hf) if causal is None else bool(causal)
    if plan is None:
        plan = hf_model.default_plan(model)
        if plan is None:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel plan of its own; pass "
                             f"plan={{'<module pattern>': 'column' | 'row' | 'norm' | ...}} (docs/parallelize.md)")
    if mesh.pp_size > 1:  # this rank's stage(s) only, before anything is split
        pipeline_cut.cut(model, mesh, stages=stages, virtual_stages=virtual_stages, placement=placement,
                         pp_plan=pp_plan, hf=hf)
    planned, attention = split_modules(model, mesh, plan, causal=causal, checkpointing=checkpointing,
                                       config_heads=hf_model.config_heads(model),
                                       whole_tables=hf or mesh.sp_size == 1, sp_mode=sp_mode,
                                       sequence_parallel=sequence_parallel, partial=mesh.pp_size > 1)
    pipeline_cut.gate_ends(model)
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
                  config_heads=None, partial: bool = False, whole_tables: bool = False,
                  sp_mode: str = "ring", sequence_parallel: bool = True) -> tuple[dict, dict]:
    """Replace every module ``plan`` covers by its style's layer, in place, after checking all
    of them (nothing changes when a check fails); the engine step both ``parallelize`` and the
    model families' stage builder (stage.py) take. ``partial``: the model is one pipeline stage
    of a model the plan describes, so entries matching no module here are fine.
    ``whole_tables``: in 1d an ``nn.Embedding`` the plan does not cover is kept whole (its
    indices are whole on every tp rank) instead of refused. ``causal``: the sp shards are
    zigzag. ``sp_mode``: under sp, "ulysses" needs each rank's heads a multiple of sp (checked
    here). ``sequence_parallel``: Megatron sequence parallelism between the blocks in 1d
    (megatron_sp.py). Returns ({name: (serial module, style, pattern)}, the attention modules
    (heads.py), whose head counts the caller makes local once its hooks that read the global
    counts are installed)."""
    planned = match_plan(model, plan, partial)
    layout = layout_of(mesh)
    for name, (module, style, _) in planned.items():  # the mesh's rules (ep) first: they name the fix
        STYLES[style].check_mesh(name, module, mesh, layout.mode)
    refuse_uncovered(model, planned, layout, whole_tables)
    if checkpointing:
        activation_checkpointing.block_names(model)  # raises when there are no blocks
    megatron_sp.check(model, planned, layout, sequence_parallel)
    attention = head_counts.attention_modules(model, planned, layout, config_heads)
    if mesh.sp_size > 1 and sp_mode == "ulysses":
        head_counts.check_ulysses(attention, mesh.sp_size)
    ctx = Build(layout, model, planned, attention, zigzag=causal)
    build_layers(ctx)  # nothing in the model has changed so far
    for name, layer in ctx.built.items():
        model.set_submodule(name, layer)
    for name, (module, style, _) in planned.items():
        STYLES[style].install(ctx.built.get(name, module), ctx.at(name))
    megatron_sp.install(model, planned, layout, sequence_parallel)
    return planned, attention


def build_layers(ctx: Build) -> dict[str, nn.Module]:
    """Each planned module's layer by its style into ``ctx.built`` (the styles that build first,
    the token table, before the others: a tied head needs it); a style keeping the module in
    place builds nothing. A layer's size rule that fails is raised naming the module."""
    order = sorted(ctx.planned, key=lambda n: not STYLES[ctx.planned[n][1]].builds_first)
    for name in order:
        module, style, _ = ctx.planned[name]
        try:
            layer = STYLES[style].build(module, ctx.at(name))
        except ValueError as err:
            if name in str(err):
                raise
            raise ValueError(f"{name} ({type(module).__name__}): {err}") from err
        if layer is not None:
            ctx.built[name] = layer
    return ctx.built


def install_checkpointing(model: nn.Module, state, checkpointing: bool) -> None:
    """Recompute each block of ``model`` in backward when ``checkpointing`` (activation_checkpointing.py)."""
    if checkpointing:
        for name in activation_checkpointing.block_names(model):
            activation_checkpointing.install(model.get_submodule(name), model, state)


def _is_causal(model: nn.Module, hf: bool) -> bool:
    if hf:
        return hf_model.is_causal_lm(model)
    flag = getattr(model, "is_causal", None)
    return flag if isinstance(flag, bool) else True


def _find(planned: dict, style: str) -> str | None:
    names = [n for n, (_, s, _) in planned.items() if s == style]
    return names[0] if len(names) == 1 else None
