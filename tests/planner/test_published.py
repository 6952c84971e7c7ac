"""The accelerator presets held to published runs (bench/published/): every row of Narayanan et
al. 2021 priced in its own layout within 15% of its published TFLOP/s per GPU, and pricing one
layout (``shardzoo.planner.api.price``, ``shardzoo plan --price``) agrees with the enumeration."""

import json
from pathlib import Path

import pytest

import shardzoo
from shardzoo.cli import main
from shardzoo.models.gpt2 import GPT2_SPEC, GPT2Config
from shardzoo.planner.api import price
from shardzoo.planner.flops import model_flops
from shardzoo.planner.walked import family_shape

DATA = Path(__file__).resolve().parents[2] / "bench" / "published" / "narayanan2021.json"
PUBLISHED = json.loads(DATA.read_text())
ROWS = [dict(zip(PUBLISHED["columns"], row)) for row in PUBLISHED["rows"]]


def gpt(row):
    config = GPT2Config(n_layer=row["layers"], n_embd=row["hidden"], n_head=row["heads"],
                        vocab_size=PUBLISHED["vocab"], n_positions=PUBLISHED["seq"])
    return family_shape(GPT2_SPEC, config, row["name"])


def priced(row):
    """The row in its published layout: its micro-batch size (pp = 1 runs the replica's batch
    as one), full recomputation, its schedule, Megatron-LM's materialized attention, and no
    sequence parallelism (the activations between tp layers replicated, as these runs held them)."""
    dp = row["gpus"] // (row["tp"] * row["pp"])
    m = 1 if row["pp"] == 1 else row["batch"] // dp // row["micro_batch"]
    v = row["virtual_stages"]
    return price(gpt(row), row["gpus"], row["batch"], PUBLISHED["seq"], dict(dp=dp, pp=row["pp"], tp=row["tp"]),
                 micro_batches=m, checkpointing=True, hardware=PUBLISHED["hardware"],
                 schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v, attention="materialized",
                 sequence_parallel=PUBLISHED["sequence_parallel"])


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_each_published_run_is_priced_within_15_percent(row):
    got = priced(row)
    assert got.candidate.fits, f"{row['name']}: the published layout is priced out of the A100's memory"
    ratio = got.model_tflops_per_device / row["tflops_per_gpu"]
    assert 0.85 <= ratio <= 1.15, f"{row['name']}: {got.model_tflops_per_device:.1f} vs {row['tflops_per_gpu']} TFLOP/s"


def test_model_flops_of_a_gpt_is_the_papers_eq_3():
    row = ROWS[0]
    b, s, l, h, v = row["batch"], PUBLISHED["seq"], row["layers"], row["hidden"], PUBLISHED["vocab"]
    eq3 = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert model_flops(gpt(row), b, s, checkpointing=True) == pytest.approx(eq3, rel=1e-12)


def test_pricing_a_layout_is_its_candidate_in_the_enumeration():
    """Under every schedule the enumeration tries (gpt2's 12 blocks split into pp * 2 chunks)."""
    planned = shardzoo.plan("gpt2", 8, 80, 16, 128, hardware="a100")
    want = dict(dp=2, pp=2, sp=1, tp=2, tp_mode="1d", tp_depth=1)
    found = {c.schedule: c for c in planned if c.layout == want and c.micro_batches == 4 and c.activation_checkpointing
             and c.zero == 1}
    assert set(found) == {"1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"}
    for schedule, cand in found.items():
        got = price("gpt2", 8, 16, 128, "dp=2,pp=2,tp=2", micro_batches=4, checkpointing=True, zero=1,
                    hardware="a100", device_memory_gib=80, schedule=schedule, virtual_stages=cand.virtual_stages)
        assert got.candidate.to_json() == cand.to_json()
        assert got.tokens_per_second_per_device == pytest.approx(16 * 128 / cand.step_seconds / 8)


def test_interleaving_shrinks_the_bubble_and_sends_more():
    one = price("gpt2", 8, 16, 128, "dp=1,pp=4,tp=2", micro_batches=8, hardware="a100")
    two = price("gpt2", 8, 16, 128, "dp=1,pp=4,tp=2", micro_batches=8, hardware="a100", schedule="interleaved",
                virtual_stages=3)
    assert two.step_seconds < one.step_seconds
    assert two.candidate.comm_bytes_per_rank_per_step > one.candidate.comm_bytes_per_rank_per_step
    with pytest.raises(ValueError, match="virtual_stages"):
        price("gpt2", 8, 16, 128, "dp=1,pp=4,tp=2", hardware="a100", virtual_stages=2)


def test_cli_prices_one_layout(capsys):
    code = main(["plan", "gpt2", "--world", "8", "--global-batch", "16", "--seq", "128", "--hardware", "a100",
                 "--price", "dp=2,pp=2,tp=2", "--micro-batches", "4", "--checkpointing", "--zero", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    want = price("gpt2", 8, 16, 128, "dp=2,pp=2,tp=2", micro_batches=4, checkpointing=True, zero=1, hardware="a100")
    assert code == 0 and out == json.loads(json.dumps(want.to_json()))
    assert main(["plan", "gpt2", "--world", "8", "--global-batch", "16", "--seq", "128", "--hardware", "a100",
                 "--price", "dp=3,tp=2"]) == 2
    assert "does not divide the world size 8" in capsys.readouterr().err
