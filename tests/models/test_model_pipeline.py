"""GPT-2 as pipeline stages under torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B; through
shardzoo.pipeline also the zero-bubble schedules, with dp and ZeRO 0 / 3) over
mesh.pp_group, composed with 1D tp, 2D tp and sp: loss and every gradient equal transformers'
unpipelined model. Also OPT, ViT and BERT (a padding mask passed to every stage) under pipelining."""

import pytest
import torch
import torch.nn.functional as F

from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_twins import converted, grads_vs_reference, hf_gpt2
from shardzoo.testing.meshes import with_world

LAYOUTS = {
    "pp2_1d_tp2": with_world(pp=2, tp=2),
    "pp2_2d_tp4": with_world(pp=2, tp=4, tp_mode="2d"),
    "pp2_sp2": with_world(pp=2, sp=2),
    "pp2_dp2": with_world(pp=2, dp=2),
}


def pipeline_stages(family_cls, config, state, mesh, case, microbatches):
    """This rank's stages (``case["virtual"]`` per rank, default 1) loaded with ``state``, and
    their schedule; returns (models, schedule)."""
    from shardzoo.models.pipeline import build_schedule

    pp, virtual = mesh.pp_size, case.get("virtual", 1)
    indices = [mesh.pp_rank + i * pp for i in range(virtual)]
    models = [family_cls(config, mesh=mesh, stage=(index, pp * virtual)) for index in indices]
    for model in models:
        model.load_full_state_dict(state, strict=True)
    schedule = build_schedule(list(zip(indices, models)), mesh, n_microbatches=microbatches,
                              schedule=case["schedule"], loss_fn=models[-1].loss)
    return models, schedule


def check_pipelined_step(models, mesh, losses, ref_loss, hf, to_shardzoo, config, tied, what):
    """After ``schedule.step``: the last stage's loss (the sum of the microbatch losses) equals ``ref_loss``
    (backpropagated here) and every stage's gradient equals transformers' (``tied``: the
    untied head's name -> the table whose gradient it carries)."""
    from shardzoo.models.pipeline import sync_tied_grads

    sync_tied_grads(models, mesh)
    ref_loss.backward()
    if models[-1].is_last:
        assert_close(torch.stack(losses).sum(), ref_loss.detach(), f"{what} loss", terms=TINY_MODEL_TERMS)
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, to_shardzoo, config)
    for head, table in tied.items():
        grads.setdefault(head, grads[table])
    for model in models:
        grads_vs_reference(model, mesh, grads, f"{what} stage")


def check_pipeline(layout, case):
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.gpt2 import hf_to_shardzoo

    mesh = cached_mesh(**LAYOUTS[layout][0])
    hf = hf_gpt2(case["seed"], n_layer=case["n_layer"])
    config = GPT2Config.from_json(hf.config.to_dict())
    models, schedule = pipeline_stages(GPT2, config, converted(hf.state_dict(), hf_to_shardzoo, config), mesh, case,
                                       case["microbatches"])
    last = models[-1]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    ids_all = torch.randint(0, config.vocab_size, (case["batch"], case["seq"] + 1), generator=gen)
    ids, target = ids_all[:, :-1], ids_all[:, 1:]
    kwargs, losses = {}, []
    first = models[0]
    args = (first.shard_input(ids),) if first.is_first else ()
    if last.is_last:
        kwargs = dict(target=last.shard_target(target), losses=losses)
    schedule.step(*args, **kwargs)
    ref_loss = F.cross_entropy(hf(ids).logits.flatten(0, 1), target.flatten())
    check_pipelined_step(models, mesh, losses, ref_loss, hf, hf_to_shardzoo, config,
                         {"lm_head.weight": "transformer.wte.weight"}, layout)
    return [list(m.transformer.h.keys()) for m in models]


def check_shardzoo_pipeline(layout, case):
    """The same stages through ``shardzoo.pipeline``, the call a transformers model cut by
    ``parallelize`` takes: this replica's full ids, padding mask and labels on every rank; the
    step's loss on every rank and every gradient equal transformers' ``labels=`` step.
    ``case["placement"] == "v"``: the stages of zbv / DualPipeV (pp_rank and 2 pp - 1 - pp_rank);
    ``case["zero"]``: each stage through ``data_parallel``; the loss of a second step after one
    SGD step is compared instead of the gradients (reduced over dp, or sharded)."""
    import shardzoo
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.gpt2 import hf_to_shardzoo

    mesh = cached_mesh(**LAYOUTS[layout][0])
    hf = hf_gpt2(case["seed"], n_layer=case["n_layer"])
    config = GPT2Config.from_json(hf.config.to_dict())
    pp, virtual = mesh.pp_size, case.get("virtual", 1)
    indices = ([mesh.pp_rank, 2 * pp - 1 - mesh.pp_rank] if case.get("placement") == "v" else
               [mesh.pp_rank + i * pp for i in range(virtual)])
    models = [GPT2(config, mesh=mesh, stage=(index, pp * virtual)) for index in indices]
    for model in models:
        model.load_full_state_dict(converted(hf.state_dict(), hf_to_shardzoo, config), strict=True)
    zero = case.get("zero")
    if zero is not None:
        models = [shardzoo.data_parallel(model, mesh, zero=zero) for model in models]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    ids = torch.randint(0, config.vocab_size, (case["batch"], case["seq"]), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    rows = slice(mesh.dp_rank * case["batch"] // mesh.dp_size, (mesh.dp_rank + 1) * case["batch"] // mesh.dp_size)
    pipe = shardzoo.pipeline(models if len(models) > 1 else models[0], mesh, n_microbatches=case["microbatches"],
                             schedule=case["schedule"])
    loss = pipe.step(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows])
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    assert_close(loss, ref.detach(), f"{layout} shardzoo.pipeline loss", terms=TINY_MODEL_TERMS)
    if zero is not None:  # the step the optimizer takes is the check (the gradients are reduced, or sharded)
        for model in models:
            shardzoo.zero_optimizer(model, torch.optim.SGD, lr=1.0).step()
        with torch.no_grad():
            for p in hf.parameters():
                p -= p.grad
        again = pipe.step(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows])
        want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss.detach()
        assert_close(again, want, f"{layout} shardzoo.pipeline loss after a step", terms=TINY_MODEL_TERMS)
        return
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, hf_to_shardzoo, config)
    grads.setdefault("lm_head.weight", grads["transformer.wte.weight"])
    for model in models:
        grads_vs_reference(model, mesh, grads, f"{layout} shardzoo.pipeline stage")


FAMILY_CASES = {
    "pp2_1d_tp2-1f1b": ("pp2_1d_tp2", {}),
    "pp2_sp2-interleaved": ("pp2_sp2", {"schedule": "interleaved_1f1b", "virtual": 2, "n_layer": 4}),
    "pp2_1d_tp2-zbv": ("pp2_1d_tp2", {"schedule": "zbv", "virtual": 2, "n_layer": 4, "placement": "v"}),
    "pp2_dp2-zero0-zero_bubble": ("pp2_dp2", {"schedule": "zero_bubble", "virtual": 2, "n_layer": 4, "zero": 0}),
    "pp2_dp2-zero3-dualpipev": ("pp2_dp2", {"schedule": "dualpipev", "virtual": 2, "n_layer": 4, "placement": "v",
                                            "zero": 3, "batch": 8, "microbatches": 4}),
}


@pytest.mark.parametrize("layout, changes", list(FAMILY_CASES.values()), ids=list(FAMILY_CASES))
def test_family_stages_run_by_shardzoo_pipeline(layout, changes):
    run_on_ranks(check_shardzoo_pipeline, LAYOUTS[layout][1], layout, {**BASE, **changes})


BASE = dict(seed=0, batch=4, seq=8, n_layer=2, microbatches=2, schedule="1f1b")
CASES = [  # pp2_1d_tp2 1f1b and pp2_sp2 interleaved: through shardzoo.pipeline below
    ("pp2_1d_tp2", {"schedule": "gpipe"}),
    ("pp2_1d_tp2", {"schedule": "interleaved", "virtual": 2, "n_layer": 4}),
    ("pp2_2d_tp4", {"schedule": "gpipe"}),
    ("pp2_2d_tp4", {}),
    ("pp2_2d_tp4", {"schedule": "interleaved", "virtual": 2, "n_layer": 4}),
    ("pp2_sp2", {"schedule": "gpipe", "microbatches": 4}),
    ("pp2_sp2", {"microbatches": 4}),
]


@pytest.mark.parametrize("layout,changes", CASES, ids=[f"{n}-{c.get('schedule', '1f1b')}" for n, c in CASES])
def test_gpt2_pipeline_matches_transformers(layout, changes):
    blocks = run_on_ranks(check_pipeline, LAYOUTS[layout][1], layout, {**BASE, **changes})
    names = sorted(int(b) for rank in blocks for stage in rank for b in stage)
    assert sorted(set(names)) == list(range({**BASE, **changes}["n_layer"]))


def check_family_pipeline(layout, family):
    """OPT (post-LN, project_in on the first stage, project_out on the last) and ViT (sequence
    padding mask rebuilt on every stage) under 1F1B: loss and gradients equal transformers'."""
    from shardzoo import models
    from shardzoo.models import opt, vit
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads
    from support.hf_twins import OPT_350M, hf_opt, hf_vit

    mesh = cached_mesh(**LAYOUTS[layout][0])
    gen = torch.Generator().manual_seed(5)
    if family == "OPT":
        hf, module = hf_opt(0, **OPT_350M), opt
        ids_all = torch.randint(0, 101, (4, 9), generator=gen)
        inputs, target = ids_all[:, :-1], ids_all[:, 1:]
        ref_loss = F.cross_entropy(hf(inputs).logits.flatten(0, 1), target.flatten())
    else:
        hf, module = hf_vit(0), vit
        inputs, target = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)
        ref_loss = F.cross_entropy(hf(inputs).logits, target)
    ref_loss.backward()
    config = getattr(models, f"{family}Config").from_json(hf.config.to_dict())
    model = getattr(models, family)(config, mesh=mesh, stage=(mesh.pp_rank, mesh.pp_size))
    model.load_full_state_dict(converted(hf.state_dict(), module.hf_to_shardzoo, config))
    schedule = build_schedule([(mesh.pp_rank, model)], mesh, n_microbatches=2, loss_fn=model.loss)
    losses = []
    if model.is_first:
        schedule.step(model.shard_input(inputs))
    else:
        schedule.step(target=model.shard_target(target), losses=losses)
    sync_tied_grads([model], mesh)
    if model.is_last:
        assert_close(torch.stack(losses).sum(), ref_loss.detach(), f"{family} {layout} loss", terms=TINY_MODEL_TERMS)
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, module.hf_to_shardzoo, config)
    grads.setdefault("lm_head.weight", grads.get("model.decoder.embed_tokens.weight"))
    grads_vs_reference(model, mesh, grads, f"{family} {layout}")
    return True


@pytest.mark.parametrize("layout,family", [("pp2_1d_tp2", "OPT"), ("pp2_sp2", "ViT")])
def test_opt_and_vit_pipeline_match_transformers(layout, family):
    assert all(run_on_ranks(check_family_pipeline, LAYOUTS[layout][1], layout, family))


def check_bert_pipeline(layout, case):
    """BERT stages with a key padding mask given to ``schedule.step`` as a keyword argument on
    every rank (the schedules split it into microbatches and pass it to every stage's forward):
    the MLM loss and every gradient equal transformers' with the same attention mask. Padded
    keys change every block's output, so a stage without the mask gives other numbers."""
    from shardzoo.models import BERT, BERTConfig
    from shardzoo.models.bert import hf_to_shardzoo
    from support.hf_twins import hf_bert

    mesh = cached_mesh(**LAYOUTS[layout][0])
    hf = hf_bert(0, num_hidden_layers=case["n_layer"])
    config = BERTConfig.from_json(hf.config.to_dict())
    models, schedule = pipeline_stages(BERT, config, converted(hf.state_dict(), hf_to_shardzoo, config), mesh, case,
                                       2)
    first, last = models[0], models[-1]
    gen = torch.Generator().manual_seed(7)
    batch, seq = 4, 8
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=gen)
    types = torch.randint(0, 2, (batch, seq), generator=gen)
    target = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    mask = torch.arange(seq)[None] < torch.tensor([[8], [3], [5], [1]])  # padding in both microbatches
    args = (first.shard_input(ids),) if first.is_first else ()
    kwargs = dict(key_padding_mask=first.shard_mask(mask), token_type_ids=first.shard_input(types))
    losses = []
    if last.is_last:
        kwargs.update(target=last.shard_target(target), losses=losses)
    schedule.step(*args, **kwargs)
    logits = hf(ids, attention_mask=mask.long(), token_type_ids=types).prediction_logits
    ref_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    check_pipelined_step(models, mesh, losses, ref_loss, hf, hf_to_shardzoo, config,
                         {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"},
                         f"BERT {layout} {case['schedule']}")
    return True


BERT_CASES = [
    ("pp2_1d_tp2", {"schedule": "1f1b", "n_layer": 2}),
    ("pp2_sp2", {"schedule": "gpipe", "n_layer": 2}),
    ("pp2_2d_tp4", {"schedule": "interleaved", "virtual": 2, "n_layer": 4}),
]


@pytest.mark.parametrize("layout,case", BERT_CASES, ids=[f"{n}-{c['schedule']}" for n, c in BERT_CASES])
def test_bert_pipeline_with_padding_mask_matches_transformers(layout, case):
    assert all(run_on_ranks(check_bert_pipeline, LAYOUTS[layout][1], layout, case))
