"""``model.loss(logits, labels=ids)`` takes a replica's full transformers-style labels and
equals transformers' ``labels=`` loss and gradients: causal LMs shift them (``shift_labels``)
before sharding, so under sp the target of a chunk's last position is the next chunk's first
label; BERT uses them as they are. The positional ``target`` keeps its meaning (no shift)."""

import pytest
import torch
import torch.nn.functional as F

from shardzoo.layers.batch_loss import shift_labels
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_twins import converted, grads_vs_reference, hf_gpt2, hf_opt, shardzoo_twin
from shardzoo.testing.meshes import with_world

MESHES = {"sp2": with_world(sp=2), "dp2_sp2": with_world(dp=2, sp=2), "1d_tp2_sp2": with_world(tp=2, sp=2)}


def test_shift_labels_is_transformers_causal_shift():
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, 2] = labels[2, 6] = -100
    shifted = shift_labels(labels)
    assert shifted[:, -1].eq(-100).all() and torch.equal(shifted[:, :-1], labels[:, 1:])
    assert_close(F.cross_entropy(logits.flatten(0, 1), shifted.flatten()), ForCausalLMLoss(logits, labels, 11),
                 "shifted cross entropy", terms=TINY_MODEL_TERMS)
    assert torch.equal(shift_labels(labels, ignore_index=-1)[:, -1], torch.full((3,), -1))
    with pytest.raises(ValueError, match=r"shape \(7,\) must be \[batch, seq\]"):
        shift_labels(labels[0])


def hf_masked_lm(seed):
    """A tiny transformers BertForMaskedLM (its ``labels=`` loss is not shifted)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, vocab_size=101, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()


TWINS = {"gpt2": (hf_gpt2, "lm_head.weight", "transformer.wte.weight", {}),
         "opt": (hf_opt, "lm_head.weight", "model.decoder.embed_tokens.weight", {}),
         "bert": (hf_masked_lm, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight",
                  {"pooler": False})}


def labels_case(family, layout, seed):
    """Each rank's ``loss(labels=)`` equals transformers' ``labels=`` loss of the global batch and
    the dp x sp averaged gradients equal its gradients; ``loss(target)`` stays unshifted."""
    from shardzoo.models.spec import spec_named

    build, head, table, kwargs = TWINS[family]
    mesh = cached_mesh(**MESHES[layout][0])
    hf = build(seed)
    model, config = shardzoo_twin(family, hf, mesh, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (4, 12), generator=gen)
    labels = torch.where(torch.rand(4, 12, generator=gen) < 0.25, -100, ids)
    out = hf(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, spec_named(family).hf_to_shardzoo, config)
    grads.setdefault(head, grads[table])
    mine = labels.chunk(mesh.dp_size)[mesh.dp_rank]  # this replica's full [B, S] labels
    logits = model(model.shard_input(ids.chunk(mesh.dp_size)[mesh.dp_rank]))
    loss = model.loss(logits, labels=mine)
    loss.backward()
    assert_close(loss.detach(), out.loss.detach(), f"{family} {layout} loss(labels=)", terms=TINY_MODEL_TERMS)
    grads_vs_reference(model, mesh, grads, f"{family} {layout} labels=")
    real = (shift_labels(labels) if model.causal else labels).ne(-100).sum()
    assert int(model.count_targets(labels=mine)) == int(real)
    # the positional target is scored as given: transformers' logits against the unshifted labels
    unshifted = model.loss(logits.detach(), model.shard_target(mine))
    assert_close(unshifted, F.cross_entropy(out.logits.detach().flatten(0, 1), labels.flatten()), "loss(target)",
                 terms=TINY_MODEL_TERMS)
    with pytest.raises(ValueError, match="either target .* or labels=.*not both"):
        model.loss(logits, model.shard_target(mine), labels=mine)
    return True


CASES = [("gpt2", "sp2"), ("opt", "dp2_sp2"), ("gpt2", "1d_tp2_sp2"), ("bert", "sp2")]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_loss_labels_equals_transformers_labels(family, layout):
    assert all(run_on_ranks(labels_case, MESHES[layout][1], family, layout, 3))
