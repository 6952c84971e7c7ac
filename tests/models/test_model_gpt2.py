"""GPT-2 against transformers' GPT2LMHeadModel (same weights): logits, loss and every gradient,
serial and in every tp_mode, with sp=2 (ring, Ulysses) and dp=2 (harness: support.hf_twins)."""

import pytest

from shardzoo.testing import run_on_ranks
from support.hf_twins import LAYOUTS, check_causal_lm, hf_gpt2


def check_gpt2(layout, case):
    hf = hf_gpt2(case["seed"], **case.get("config", {}))
    return check_causal_lm("gpt2", hf, layout, case, "transformer.wte.weight")


BASE = dict(seed=0, batch=4, seq=8)
CASES = [  # 1d tp2 runs inside 1d_tp2_sp2 / 1d_tp2_dp2, and 2d tp4 inside 2d_tp4_sp2
    ("serial", {}),
    ("1d_tp4", {}),
    ("1d_tp2_sp2", {}),
    ("1d_tp2_sp2", {"sp_mode": "ulysses"}),
    ("1d_tp2_dp2", {}),
    ("2d_tp4_sp2", {}),
    ("2.5d_tp8", {}),
    ("3d_tp8", {}),
]


@pytest.mark.parametrize("layout,changes", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_gpt2_matches_transformers(layout, changes):
    run_on_ranks(check_gpt2, LAYOUTS[layout][1], layout, {**BASE, **changes})
