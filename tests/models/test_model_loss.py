"""The training loss is the global token mean: ``model.loss`` against transformers' ``labels=``
loss and every gradient (fp32), with ignored targets spread unevenly over sp ranks (zigzag puts
the last, ignored position of every causal row on sp rank 0), dp replicas, pipeline
microbatches and gradient-accumulation micro-batches. Also reduction="sum", label smoothing,
a batch without real targets, and errors."""

import pytest
import torch
import torch.nn.functional as F

from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of
from support.hf_twins import converted, grads_vs_reference, hf_gpt2, shardzoo_twin
from shardzoo.testing.meshes import with_world

MESHES = {
    "sp2": with_world(sp=2),
    "1d_tp2_sp2": with_world(tp=2, sp=2),
    "dp2_sp2": with_world(dp=2, sp=2),
    "2d_tp4_sp2": with_world(tp=4, tp_mode="2d", sp=2),
    "3d_tp8": with_world(tp=8, tp_mode="3d"),
    "2d_tp4": with_world(tp=4, tp_mode="2d"),
    "pp2_sp2": with_world(pp=2, sp=2),
}
BATCH, SEQ = 4, 12  # zigzag over sp=2: rank 0 holds positions 0-2 and 9-11 of every row


def causal_batch(seed, vocab, holes=0.25, batch=BATCH, seq=SEQ):
    """(ids, labels, targets) [B, S]: transformers' ``labels=`` (shifted inside the model) with
    a fraction ``holes`` of -100, and the same targets shifted by hand, -100 at the last position."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.where(torch.rand(batch, seq, generator=gen) < holes, -100, ids)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = labels[:, 1:]
    return ids, labels, targets


def dp_block(t, mesh):
    return t.chunk(mesh.dp_size)[mesh.dp_rank]


def reference(hf, inputs: dict, to_shardzoo, config, tied: dict):
    """transformers' ``labels=`` loss of the global batch and its gradients in shardzoo names."""
    hf.zero_grad()
    loss = hf(**inputs).loss
    loss.backward()
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, to_shardzoo, config)
    for head, table in tied.items():
        grads.setdefault(head, grads[table])
    return loss.detach(), grads


def relative_error(actual, expected) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


# -- the reported case ---------------------------------------------------------------------------
def issue_case(hf_dir, ids, targets, ref_loss, ref_grads):
    """GPT-2 from a transformers directory on ParallelMesh(sp=2), targets shifted the usual way,
    gradients through average_grads: (per-rank real targets, largest relative errors)."""
    from shardzoo.models import GPT2
    from shardzoo.models.training import average_grads

    mesh = cached_mesh(sp=2)
    model = GPT2.from_pretrained(hf_dir, mesh=mesh)
    local = model.shard_target(targets)
    loss = model.loss(model(model.shard_input(ids)), local)
    loss.backward()
    average_grads(model, mesh)
    errors = {"loss": relative_error(loss.detach(), ref_loss)}
    for name, p in model.named_parameters():
        errors[name] = relative_error(gather_full(p.grad, get_shard_spec(model, name), mesh), ref_grads[name])
    return int((local != -100).sum()), errors


def test_issue_case_gpt2_sp2_equals_transformers(tmp_path):
    from shardzoo.models.gpt2 import GPT2Config, hf_to_shardzoo

    hf = hf_gpt2(0)
    hf.save_pretrained(tmp_path)
    ids, _, targets = causal_batch(1, hf.config.vocab_size, holes=0.0)
    labels = ids  # transformers shifts: the last position has no target
    ref_loss, ref_grads = reference(hf, dict(input_ids=ids, labels=labels), hf_to_shardzoo,
                                    GPT2Config.from_json(hf.config.to_dict()), {"lm_head.weight": "transformer.wte.weight"})
    results = run_on_ranks(issue_case, 2, str(tmp_path), ids, targets, ref_loss, ref_grads)
    assert [n for n, _ in results] == [20, 24]  # unbalanced: a mean per rank would be wrong
    for _, errors in results:
        assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


# -- causal LMs on every kind of split -------------------------------------------------------------
def causal_case(family, layout, seed):
    """Each rank's loss equals transformers' loss of the global batch; the gradients averaged
    over dp x sp equal its gradients."""
    from shardzoo.models.spec import spec_named
    from support.hf_twins import hf_opt

    mesh = cached_mesh(**MESHES[layout][0])
    hf = hf_gpt2(seed) if family == "gpt2" else hf_opt(seed)
    table = "transformer.wte.weight" if family == "gpt2" else "model.decoder.embed_tokens.weight"
    model, config = shardzoo_twin(family, hf, mesh)
    ids, labels, targets = causal_batch(seed + 1, config.vocab_size)
    ref_loss, grads = reference(hf, dict(input_ids=ids, labels=labels), spec_named(family).hf_to_shardzoo,
                                config, {"lm_head.weight": table})
    ids, targets = dp_block(ids, mesh), dp_block(targets, mesh)
    loss = model.loss(model(model.shard_input(ids)), model.shard_target(targets))
    loss.backward()
    assert_close(loss.detach(), ref_loss, f"{family} {layout} loss", terms=TINY_MODEL_TERMS)
    grads_vs_reference(model, mesh, grads, f"{family} {layout}")
    return True


CAUSAL = [("gpt2", "sp2"), ("opt", "sp2"), ("gpt2", "1d_tp2_sp2"), ("gpt2", "dp2_sp2"), ("gpt2", "2d_tp4_sp2"),
          ("gpt2", "3d_tp8")]


@pytest.mark.parametrize("family,layout", CAUSAL, ids=[f"{f}-{m}" for f, m in CAUSAL])
def test_causal_lm_loss_is_global_token_mean(family, layout):
    assert all(run_on_ranks(causal_case, MESHES[layout][1], family, layout, 3))


def pipeline_case(seed, microbatches):
    """pp=2 x sp=2, 1F1B over 4 microbatches of one row each (unequal real targets): the
    microbatch losses sum to transformers' loss and the gradients equal its gradients."""
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.gpt2 import hf_to_shardzoo
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads
    from shardzoo.models.training import average_grads

    mesh = cached_mesh(**MESHES["pp2_sp2"][0])
    hf = hf_gpt2(seed)
    config = GPT2Config.from_json(hf.config.to_dict())
    ids, labels, targets = causal_batch(seed + 1, config.vocab_size)
    ref_loss, grads = reference(hf, dict(input_ids=ids, labels=labels), hf_to_shardzoo, config,
                                {"lm_head.weight": "transformer.wte.weight"})
    model = GPT2(config, mesh=mesh, stage=(mesh.pp_rank, 2))
    model.load_full_state_dict(converted(hf.state_dict(), hf_to_shardzoo, config))
    schedule = build_schedule([(mesh.pp_rank, model)], mesh, n_microbatches=microbatches, loss_fn=model.loss)
    losses = []
    if model.is_first:
        schedule.step(model.shard_input(ids))
        with pytest.raises(ValueError, match="stage has no head .* so it has no count_targets"):
            model.count_targets(targets)
    else:
        schedule.step(target=model.shard_target(targets), losses=losses)
        assert_close(torch.stack(losses).sum().detach(), ref_loss, "pipelined loss", terms=TINY_MODEL_TERMS)
    sync_tied_grads([model], mesh)
    average_grads(model, mesh)
    floor = rms_of(grads.values())
    for name, p in model.named_parameters():
        assert_close(gather_full(p.grad, get_shard_spec(model, name), mesh), grads[name], f"pipelined grad {name}",
                     terms=TINY_MODEL_TERMS, floor=floor)
    return True


def test_pipeline_microbatches_share_the_step_count():
    assert all(run_on_ranks(pipeline_case, 4, 5, 4))


def accumulation_case(seed):
    """Two micro-batches on dp=2 x sp=2, each loss divided by the step's count of real targets
    (``count_targets`` of both): the accumulated gradients are those of the whole batch."""
    from shardzoo.models.gpt2 import hf_to_shardzoo

    mesh = cached_mesh(**MESHES["dp2_sp2"][0])
    hf = hf_gpt2(seed)
    model, config = shardzoo_twin("gpt2", hf, mesh)
    ids, labels, targets = causal_batch(seed + 1, config.vocab_size, batch=8)
    ref_loss, grads = reference(hf, dict(input_ids=ids, labels=labels), hf_to_shardzoo, config,
                                {"lm_head.weight": "transformer.wte.weight"})
    micro = list(zip(dp_block(ids, mesh).chunk(2), dp_block(targets, mesh).chunk(2)))
    num_targets = model.count_targets([model.shard_target(t) for _, t in micro])
    assert int(num_targets) == int((targets != -100).sum())
    total = 0.0
    for mb_ids, mb_targets in micro:
        loss = model.loss(model(model.shard_input(mb_ids)), model.shard_target(mb_targets), num_targets=num_targets)
        loss.backward()
        total = total + loss.detach()
    assert_close(total, ref_loss, "accumulated loss", terms=TINY_MODEL_TERMS)
    grads_vs_reference(model, mesh, grads, "accumulated")
    return True


def test_gradient_accumulation_over_two_micro_batches():
    assert all(run_on_ranks(accumulation_case, 4, 7))


# -- BERT (padding carries -100) and ViT (labels, not split over sp) -----------------------------
def bert_case(layout, seed):
    """BertForMaskedLM's ``labels=`` loss with padded positions and random others at -100."""
    from transformers import BertConfig, BertForMaskedLM

    from shardzoo.models.bert import hf_to_shardzoo

    mesh = cached_mesh(**MESHES[layout][0])
    torch.manual_seed(seed)
    hf = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    vocab_size=101, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)).eval()
    model, config = shardzoo_twin("bert", hf, mesh, pooler=False)
    gen = torch.Generator().manual_seed(seed + 1)
    batch, seq = 4, 8
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=gen)
    mask = torch.arange(seq)[None] < torch.tensor([8, 3, 6, 2])[:, None]
    labels = torch.where(mask & (torch.rand(batch, seq, generator=gen) < 0.6), ids, -100)
    ref_loss, grads = reference(hf, dict(input_ids=ids, attention_mask=mask.long(), labels=labels), hf_to_shardzoo,
                                config, {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"})
    ids, mask, labels = (dp_block(t, mesh) for t in (ids, mask, labels))
    loss = model.loss(model(model.shard_input(ids), model.shard_mask(mask)), model.shard_target(labels))
    loss.backward()
    assert_close(loss.detach(), ref_loss, f"BERT {layout} loss", terms=TINY_MODEL_TERMS)
    grads_vs_reference(model, mesh, grads, f"BERT {layout}")
    return True


@pytest.mark.parametrize("layout", ["dp2_sp2", "2d_tp4"])
def test_bert_masked_lm_loss_with_padding(layout):
    assert all(run_on_ranks(bert_case, MESHES[layout][1], layout, 11))


def vit_case(seed):
    """ViT on dp=2 x sp=2, one label of one replica ignored: the global mean over 3 labels."""
    from shardzoo.models.vit import hf_to_shardzoo
    from support.hf_twins import hf_vit

    mesh = cached_mesh(**MESHES["dp2_sp2"][0])
    hf = hf_vit(seed)
    model, config = shardzoo_twin("vit", hf, mesh)
    gen = torch.Generator().manual_seed(seed + 1)
    pixels, labels = torch.randn(4, 3, 8, 8, generator=gen), torch.tensor([1, -100, 4, 2])
    ref_loss, grads = reference(hf, dict(pixel_values=pixels, labels=labels), hf_to_shardzoo, config, {})
    loss = model.loss(model(model.shard_input(dp_block(pixels, mesh))), model.shard_target(dp_block(labels, mesh)))
    loss.backward()
    assert_close(loss.detach(), ref_loss, "ViT loss", terms=TINY_MODEL_TERMS)
    grads_vs_reference(model, mesh, grads, "ViT")
    return True


def test_vit_loss_is_global_mean_over_real_labels():
    assert all(run_on_ranks(vit_case, 4, 13))


# -- torch's semantics: sum, label smoothing, nothing to learn from, bad arguments ---------------------
def semantics_case(seed):
    """On sp=2: reduction="sum" and label_smoothing as F.cross_entropy on the global batch; a
    batch with every target ignored gives nan and zero gradients, as torch; num_targets with
    "sum" is refused."""
    mesh = cached_mesh(sp=2)
    hf = hf_gpt2(seed)
    model, config = shardzoo_twin("gpt2", hf, mesh)
    ids, _, targets = causal_batch(seed + 1, config.vocab_size)
    logits_ref = hf(ids).logits.detach().flatten(0, 1)
    local_ids, local_targets = model.shard_input(ids), model.shard_target(targets)
    for kwargs in (dict(reduction="sum"), dict(label_smoothing=0.1), dict(reduction="sum", label_smoothing=0.2)):
        loss = model.loss(model(local_ids), local_targets, **kwargs)
        assert_close(loss.detach(), F.cross_entropy(logits_ref, targets.flatten(), **kwargs), f"loss {kwargs}",
                     terms=TINY_MODEL_TERMS)
    model.zero_grad()
    empty = torch.full_like(targets, -100)
    loss = model.loss(model(local_ids), model.shard_target(empty))
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits_ref, empty.flatten()))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    with pytest.raises(ValueError, match="num_targets=3 divides the 'mean' only"):
        model.loss(model(local_ids), local_targets, reduction="sum", num_targets=3)
    with pytest.raises(ValueError, match="reduction='avg' is not one of"):
        model.loss(model(local_ids), local_targets, reduction="avg")
    return True


def test_sum_smoothing_empty_batch_and_errors_follow_torch():
    assert all(run_on_ranks(semantics_case, 2, 17))
