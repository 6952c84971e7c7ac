"""OPT against transformers' OPTForCausalLM (same weights): logits, loss and every gradient in
every tp_mode, with sp=2 and with dp=2, each for pre-LN (opt-125m style) and for post-LN with
project_in / project_out (opt-350m style)."""

import pytest

from shardzoo.testing import run_on_ranks
from support.hf_twins import LAYOUTS, OPT_350M, check_causal_lm, hf_opt


def check_opt(layout, case):
    hf = hf_opt(case["seed"], **case.get("config", {}))
    check_causal_lm("opt", hf, layout, case, "model.decoder.embed_tokens.weight", pad_id=hf.config.pad_token_id)
    return True


VARIANTS = {"pre_ln": {}, "350m": {"config": OPT_350M}}  # opt-125m style; post-LN with project_in / project_out
LAYOUT_NAMES = ["serial", "1d_tp2", "1d_tp4", "1d_tp2_sp2", "1d_tp2_dp2", "2d_tp4", "2.5d_tp8", "3d_tp8"]


# the 350m variant (post-LN, project_in / project_out) once per tp_mode, with sp and dp in 1d
CASES = [(layout, "pre_ln") for layout in LAYOUT_NAMES] + \
    [(layout, "350m") for layout in ("serial", "1d_tp2_sp2", "1d_tp2_dp2", "2d_tp4", "2.5d_tp8", "3d_tp8")]


@pytest.mark.parametrize("layout, variant", CASES)
def test_opt_matches_transformers(layout, variant):
    run_on_ranks(check_opt, LAYOUTS[layout][1], layout, {"seed": 0, "batch": 4, "seq": 8, **VARIANTS[variant]})
