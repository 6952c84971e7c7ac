"""Save in one layout, load in another: bit-exact full tensors, zero padding, any world size."""

import os

import pytest

from support.checkpoint_stack import load_stack, run, save_stack

# (saved from, loaded into); pool sizes differ where the world changes
PAIRS = [
    ("2d", "1d_tp2"),
    ("2d", "3d"),
    ("1d_tp4", "serial"),
    ("3d", "2d"),
    ("1d_dp2_tp2", "1d_tp4"),
    ("2.5d", "1d_tp2"),
    ("serial", "2.5d"),
    ("1d_pp2_tp2", "2d"),
    ("3d", "1d_pp2_tp2"),
]
NAMES = ["emb.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "ln.bias", "ln.weight"]


@pytest.mark.parametrize("saved, loaded", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_reshard_round_trip(tmp_path, saved, loaded):
    ckpt = str(tmp_path / "ckpt")
    run(saved, save_stack, 11, ckpt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp dir left behind
    held = run(loaded, load_stack, ckpt, 11)
    assert sorted({n for names in held for n in names}) == NAMES


def test_replicas_written_once(tmp_path):
    """dp=2 x tp=2: only dp rank 0 writes; the replicated LayerNorm is one piece."""
    import json

    ckpt = str(tmp_path / "ckpt")
    run("1d_dp2_tp2", save_stack, 3, ckpt)
    index = json.load(open(os.path.join(ckpt, "index.json")))
    assert sorted(index["files"]) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert len(index["tensors"]["ln.weight"]["pieces"]) == 1
    assert len(index["tensors"]["fc2.bias"]["pieces"]) == 1  # row-parallel bias: replicated over tp
    pieces = index["tensors"]["emb.weight"]["pieces"]
    assert [(p["offsets"], p["shape"]) for p in pieces] == [([0, 0], [7, 8]), ([7, 0], [6, 8])]  # padding dropped
    assert index["layout"] == {"world_size": 4, "dp": 2, "pp": 1, "sp": 1, "tp": 2, "tp_mode": "1d", "tp_depth": 1}
    assert index["config"] == {"vocab_size": 13, "hidden_size": 8, "ffn_size": 16}


def test_pipeline_stages_write_their_own(tmp_path):
    """pp=2 x tp=2: each stage's tp ranks write that stage's tensors under global names."""
    import json

    ckpt = str(tmp_path / "ckpt")
    run("1d_pp2_tp2", save_stack, 3, ckpt)
    index = json.load(open(os.path.join(ckpt, "index.json")))
    assert sorted(index["tensors"]) == NAMES
    files = {n: sorted({p["file"] for p in e["pieces"]}) for n, e in index["tensors"].items()}
    assert files["emb.weight"] == ["shard-00000.safetensors", "shard-00001.safetensors"]  # stage 0 = ranks 0, 1
    assert files["fc1.weight"] == ["shard-00002.safetensors", "shard-00003.safetensors"]  # stage 1 = ranks 2, 3
    assert files["ln.weight"] == ["shard-00000.safetensors"] and files["fc2.bias"] == ["shard-00002.safetensors"]
