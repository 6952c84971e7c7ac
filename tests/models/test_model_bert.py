"""BERT against transformers' BertForPreTraining (same weights): MLM logits, pooler output and
every gradient, with key padding masks and token types, in every tp_mode, with sp=2 and dp=2."""

import pytest
import torch
import torch.nn.functional as F

from shardzoo.testing import assert_close, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_twins import LAYOUTS, converted, dp_rows, grads_vs_reference, hf_bert, mesh_of, shardzoo_twin


def check_bert(layout, case):
    from shardzoo.models.bert import hf_to_shardzoo

    mesh = mesh_of(layout)
    hf = hf_bert(case["seed"])
    model, config = shardzoo_twin("bert", hf, mesh, sp_mode=case.get("sp_mode", "ring"))
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    batch, seq = case["batch"], case["seq"]
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=gen)
    types = torch.randint(0, 2, (batch, seq), generator=gen)
    target = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None] < lengths[:, None]
    weight = torch.randn(batch, config.hidden_size, generator=gen)
    out = hf(ids, attention_mask=mask.long(), token_type_ids=types)
    pooled_ref = hf.bert(ids, attention_mask=mask.long(), token_type_ids=types).pooler_output
    # each dp replica feeds its own rows of the global batch
    full_target, full_weight = target, weight
    ids, types, target, mask, weight = (dp_rows(t, mesh) for t in (ids, types, target, mask, weight))
    hidden = model.embed(model.shard_input(ids), model.shard_input(types))
    local_mask = model.shard_mask(mask)
    for block in model.bert.encoder.layer.values():
        hidden = block(hidden, local_mask)
    logits = model.mlm_logits(hidden)
    pooled = model.gather_pooled(model.pool(hidden))
    assert_close(model.gather_output(logits), dp_rows(out.prediction_logits, mesh), f"{layout} MLM logits",
                 terms=TINY_MODEL_TERMS)
    assert_close(pooled, dp_rows(pooled_ref, mesh), f"{layout} pooled", terms=TINY_MODEL_TERMS)
    loss = model.loss(logits, model.shard_target(target)) + (pooled * weight).sum()
    loss.backward()
    hf.zero_grad()
    # the replicas' gradients are averaged: the mean MLM loss of the global batch plus 1/dp of the pooled sum
    (F.cross_entropy(out.prediction_logits.flatten(0, 1), full_target.flatten())
     + (pooled_ref * full_weight).sum() / mesh.dp_size).backward()
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, hf_to_shardzoo, config)
    grads.setdefault("cls.predictions.decoder.weight", grads["bert.embeddings.word_embeddings.weight"])
    grads_vs_reference(model, mesh, grads, layout)
    return True


CASES = [  # 1d tp2 runs inside 1d_tp2_sp2 / 1d_tp2_dp2, and 2d tp4 inside 2d_tp4_sp2
    ("serial", {}),
    ("1d_tp4", {}),
    ("1d_tp2_dp2", {}),
    ("1d_tp2_sp2", {}),
    ("1d_tp2_sp2", {"sp_mode": "ulysses"}),
    ("2d_tp4_sp2", {}),
    ("2.5d_tp8", {}),
    ("3d_tp8", {}),
]


@pytest.mark.parametrize("layout,changes", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_bert_matches_transformers(layout, changes):
    run_on_ranks(check_bert, LAYOUTS[layout][1], layout, {"seed": 0, "batch": 4, "seq": 8, **changes})
