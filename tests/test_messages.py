"""Messages that used to mislead: a model family shardzoo does not implement (demo --weights), a
missing model directory, and ``convert`` of a checkpoint saved from a transformers model (which
exports its saved names and config as they are: transformers loads the result)."""

import argparse
import json

import pytest
import torch

from shardzoo import checkpoint
from shardzoo.checkpoint import CheckpointError
from shardzoo.checkpoint.cli import add_convert_parser
from shardzoo.cli import main


def test_demo_weights_of_an_unknown_family_names_the_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 8}))
    assert main(["demo", "--weights", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "describes a 'llama' model, which shardzoo does not implement (its families: bert, gpt2, opt, vit)" in err
    assert "--family llama" not in err  # argparse would reject it


def test_from_pretrained_of_a_missing_directory_says_so(tmp_path):
    from shardzoo.models import GPT2

    with pytest.raises(CheckpointError, match=r"nowhere: no such directory; pass the Hugging Face model directory"):
        GPT2.from_pretrained(str(tmp_path / "nowhere"), mesh=None)
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        GPT2.from_pretrained(str(tmp_path), mesh=None)  # a directory without config.json: that message stays


def convert(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_convert_parser(parser.add_subparsers())
    args = parser.parse_args(["convert", *argv, "--no-progress"])
    return args.func(args)


def test_convert_of_a_transformers_model_keeps_its_names(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)).eval()
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    checkpoint.save(hf, ckpt)  # a plain module in one process: its own transformers config is recorded
    assert convert(ckpt, out) == 0, capsys.readouterr().out  # the default --names hf: its names already are
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hf(ids).logits, rtol=0, atol=0)
