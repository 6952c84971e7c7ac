"""OPT against transformers' OPTForCausalLM (same weights): logits, loss and every gradient in
every tp_mode and with sp=2, pre-LN (opt-125m style) and post-LN with project_in / project_out
(opt-350m style)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardzoo.testing import assert_close, run_on_ranks
from test_model_gpt2 import LAYOUTS, converted, dp_rows, grads_vs_reference, mesh_of, shardzoo_twin


def hf_opt(seed, **overrides):
    from transformers import OPTConfig as HFConfig
    from transformers import OPTForCausalLM

    torch.manual_seed(seed)
    cfg = dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, vocab_size=101,
               max_position_embeddings=32, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    cfg.update(overrides)
    return OPTForCausalLM(HFConfig(**cfg)).eval()


def check_opt(layout, case):
    from shardzoo.models.opt import hf_to_shardzoo

    mesh = mesh_of(layout)
    hf = hf_opt(case["seed"], **case.get("config", {}))
    model, config = shardzoo_twin("opt", hf, mesh)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    ids_all = torch.randint(0, config.vocab_size, (case["batch"], case["seq"] + 1), generator=gen)
    ids_all[0, :3] = config.pad_token_id  # the padding row gets no gradient, as in HF
    ids, target = dp_rows(ids_all[:, :-1], mesh), dp_rows(ids_all[:, 1:], mesh)
    ref = hf(ids).logits
    logits = model(model.shard_input(ids))
    assert_close(model.gather_output(logits), ref, f"{layout} logits", scale=5)
    loss = model.loss(logits, model.shard_target(target))
    loss.backward()
    sp_mean = loss.detach().clone()
    dist.all_reduce(sp_mean, group=mesh.sp_group)
    assert_close(sp_mean / mesh.sp_size, F.cross_entropy(ref.flatten(0, 1), target.flatten()).detach(),
                 f"{layout} loss", scale=5)
    hf.zero_grad()
    F.cross_entropy(hf(ids_all[:, :-1]).logits.flatten(0, 1), ids_all[:, 1:].flatten()).backward()
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, hf_to_shardzoo, config)
    grads.setdefault("lm_head.weight", grads["model.decoder.embed_tokens.weight"])
    grads_vs_reference(model, mesh, grads, layout)
    return True


OPT_350M = {"do_layer_norm_before": False, "word_embed_proj_dim": 32}
CASES = [
    ("serial", {}),
    ("serial", {"config": OPT_350M}),
    ("1d_tp2", {"config": OPT_350M}),
    ("1d_tp2_sp2", {}),
    ("2d_tp4", {"config": OPT_350M}),
    ("2.5d_tp8", {}),
    ("3d_tp8", {"config": OPT_350M}),
]


@pytest.mark.parametrize("layout,changes", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_opt_matches_transformers(layout, changes):
    run_on_ranks(check_opt, LAYOUTS[layout][1], layout, {"seed": 0, "batch": 4, "seq": 8, **changes})
