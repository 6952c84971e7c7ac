"""export_plain: sharded checkpoint -> plain safetensors equal to the serial state dict."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from shardzoo import checkpoint
from shardzoo.checkpoint import CheckpointError, export_plain
from shardzoo.checkpoint.cli import parse_size
from support.checkpoint_stack import CONFIG, run, save_stack, serial_stack


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
    args = [sys.executable, "-c", code, "convert", ckpt, out, "--max-shard-size", "1KB", "--no-progress"]
    # not a model family: no Hugging Face names, so the default refuses and writes nothing
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "saved without the config of a shardzoo model family" in done.stdout and "--names shardzoo" in done.stdout
    assert not os.path.exists(out)
    done = subprocess.run(args + ["--names", "shardzoo"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
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


@pytest.mark.parametrize("path", ["copy_file_range", "pwrite", "decode"])
def test_export_copy_paths_agree(tmp_path, monkeypatch, path):
    """The byte-copying export (kernel copy, or gathered writes from the memory maps) and the
    decoding one give the same file: 1d_tp4 cuts fc2.weight along dim 1 (pieces are strided
    runs of the full tensor), the embedding along dim 0 (one run each)."""
    from shardzoo.checkpoint import bytecopy

    if path == "pwrite":
        monkeypatch.setattr(bytecopy, "_copy_file_range_works", False)
    if path == "decode":
        monkeypatch.setattr(bytecopy, "MAX_RUNS", 0)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run("1d_tp4", save_stack, 12, ckpt)
    pieces = checkpoint_pieces(ckpt)
    assert pieces["fc2.weight"] == [([0, 0], [8, 4]), ([0, 4], [8, 4]), ([0, 8], [8, 4]), ([0, 12], [8, 4])]
    assert pieces["emb.weight"][:2] == [([0, 0], [4, 8]), ([4, 0], [4, 8])]
    export_plain(ckpt, out, progress=False)
    ref = serial_stack(12).state_dict()
    state = read_export(out)
    assert state.keys() == ref.keys() and all(torch.equal(state[k], v) for k, v in ref.items())
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def checkpoint_pieces(ckpt):
    index = json.load(open(os.path.join(ckpt, "index.json")))
    return {n: [(p["offsets"], p["shape"]) for p in e["pieces"]] for n, e in index["tensors"].items()}


def test_failed_export_leaves_previous_output(tmp_path):
    """A piece failing its crc32 stops the export before the file is renamed into place: the
    previous model.safetensors stays, no partial file is left."""
    from shardzoo.checkpoint.safetensors_io import read_header

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run("serial", save_stack, 13, ckpt)
    export_plain(ckpt, out, progress=False)
    before = open(os.path.join(out, "model.safetensors"), "rb").read()
    piece = checkpoint.read_index(ckpt)["tensors"]["fc2.weight"]["pieces"][0]
    shard = os.path.join(ckpt, piece["file"])
    header, data_start = read_header(shard)
    with open(shard, "r+b") as f:
        f.seek(data_start + header[piece["key"]]["data_offsets"][0] + 3)
        f.write(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"piece 'model/fc2.weight@0,0' of tensor 'fc2.weight' fails its crc32"):
        export_plain(ckpt, out, progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == before


def test_byte_runs_of_a_box():
    """byte_runs: the byte runs a box occupies in its row-major full tensor, against slicing."""
    import random

    from shardzoo.checkpoint.bytecopy import byte_runs

    rng = random.Random(0)
    for _ in range(300):
        full_shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]
        offsets = [rng.randint(0, g - 1) for g in full_shape]
        shape = [rng.randint(1, g - o) for g, o in zip(full_shape, offsets)]
        full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.int32).reshape(full_shape)
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))].contiguous()
        full_bytes, box_bytes = full.numpy().tobytes(), box.numpy().tobytes()
        runs = byte_runs(offsets, shape, full_shape, 4)
        assert sum(n for _, _, n in runs) == len(box_bytes)
        assert [dst for _, dst, _ in runs] == sorted(dst for _, dst, _ in runs)
        for src, dst, n in runs:
            assert box_bytes[src:src + n] == full_bytes[dst:dst + n], (full_shape, offsets, shape)
