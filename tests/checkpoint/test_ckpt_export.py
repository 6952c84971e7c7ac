"""export_plain: sharded checkpoint -> plain safetensors equal to the serial state dict."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from ckpt_stack import CONFIG, run, save_stack, serial_stack
from shardzoo.checkpoint import export_plain
from shardzoo.checkpoint.cli import parse_size


def read_export(out):
    state = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(out, name)))
    return state


def test_export_equals_serial_state_dict(tmp_path):
    ckpt, out, split = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "hf-split")
    run("2d", save_stack, 7, ckpt)
    ref = serial_stack(7).state_dict()

    export_plain(ckpt, out, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    state = read_export(out)
    assert state.keys() == ref.keys() and all(torch.equal(state[k], v) for k, v in ref.items())
    assert json.load(open(os.path.join(out, "config.json"))) == CONFIG

    export_plain(ckpt, split, max_shard_bytes=600, progress=False)  # several files + HF index
    index = json.load(open(os.path.join(split, "model.safetensors.index.json")))
    files = sorted(f for f in os.listdir(split) if f.endswith(".safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(ref) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    state = read_export(split)
    assert all(torch.equal(state[k], v) for k, v in ref.items())


def hf_names(name, t):
    """A rename hook as model families will write them: new names, a transpose, a dropped tensor."""
    if name == "ln.bias":
        return []
    if name == "fc1.weight":
        return [("transformer.fc_in.weight_t", t.t().contiguous())]
    return [(f"transformer.{name}", t)]


def test_export_rename_hook(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run("1d_tp4", save_stack, 8, ckpt)
    export_plain(ckpt, out, rename=hf_names, progress=False)
    ref = serial_stack(8).state_dict()
    state = read_export(out)
    assert "transformer.ln.bias" not in state and len(state) == len(ref) - 1
    assert torch.equal(state["transformer.fc_in.weight_t"], ref["fc1.weight"].t())
    assert torch.equal(state["transformer.emb.weight"], ref["emb.weight"])


def test_convert_command(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run("serial", save_stack, 9, ckpt)
    code = ("import argparse, sys; from shardzoo.checkpoint.cli import add_convert_parser; p = argparse.ArgumentParser(); "
            "s = p.add_subparsers(); add_convert_parser(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    done = subprocess.run([sys.executable, "-c", code, "convert", ckpt, out, "--max-shard-size", "1KB", "--no-progress"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "model.safetensors.index.json" in os.listdir(out)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("123") == 123


def test_dataclass_config_and_tied_weights(tmp_path):
    """A dataclass config is stored with its class path and exported as config.json; a tied
    weight is stored once and recorded as an alias."""
    from dataclasses import dataclass

    from torch import nn

    from shardzoo import checkpoint

    @dataclass
    class TinyConfig:
        vocab_size: int = 13
        tie_word_embeddings: bool = True

    model = serial_stack(3)
    model.head = nn.Linear(8, 13, bias=False)
    model.head.weight = model.emb.weight
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    checkpoint.save(model, ckpt, config=TinyConfig())
    index = checkpoint.read_index(ckpt)
    assert index["config"] == {"vocab_size": 13, "tie_word_embeddings": True}
    assert index["config_class"].endswith("TinyConfig") and index["aliases"] == {"head.weight": "emb.weight"}
    export_plain(ckpt, out, progress=False)
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is True
    assert "head.weight" not in read_export(out)
    fresh = serial_stack(4)
    fresh.head = nn.Linear(8, 13, bias=False)
    fresh.head.weight = fresh.emb.weight
    checkpoint.load(fresh, ckpt)
    assert torch.equal(fresh.head.weight, model.emb.weight)
