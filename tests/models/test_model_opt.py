"""OPT against transformers' OPTForCausalLM (same weights): logits, loss and every gradient in
every tp_mode and with sp=2, pre-LN (opt-125m style) and post-LN with project_in / project_out
(opt-350m style)."""

import pytest
import torch

from shardzoo.testing import run_on_ranks
from test_model_gpt2 import LAYOUTS, check_causal_lm


def hf_opt(seed, **overrides):
    from transformers import OPTConfig as HFConfig
    from transformers import OPTForCausalLM

    torch.manual_seed(seed)
    cfg = dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, vocab_size=101,
               max_position_embeddings=32, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    cfg.update(overrides)
    return OPTForCausalLM(HFConfig(**cfg)).eval()


def check_opt(layout, case):
    hf = hf_opt(case["seed"], **case.get("config", {}))
    check_causal_lm("opt", hf, layout, case, "model.decoder.embed_tokens.weight", pad_id=hf.config.pad_token_id)
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
