"""Bad inputs are named: truncated / corrupted / missing files, an index that does not match the
model, a save that dies midway (the previous checkpoint survives, no loadable temp dir)."""

import json
import os
import shutil

import pytest
import torch
from torch import nn

from shardzoo import checkpoint
from shardzoo.checkpoint import CheckpointError
from support.checkpoint_stack import Stack, load_error, load_stack, run, save_failing_on, save_stack, serial_stack


@pytest.fixture
def saved(tmp_path):
    """A serial checkpoint (one shard file) and its model."""
    model = serial_stack(5)
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(model, ckpt, config={"hidden_size": 8})
    return ckpt, model


def shard_path(ckpt):
    return os.path.join(ckpt, "shard-00000.safetensors")


def test_truncated_shard(saved):
    ckpt, _ = saved
    path = shard_path(ckpt)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError, match=r"shard-00000.safetensors is \d+ bytes but the index records \d+: the file is truncated"):
        checkpoint.load(serial_stack(0), ckpt)


def test_corrupted_bytes(saved):
    ckpt, model = saved
    index = checkpoint.read_index(ckpt)
    piece = index["tensors"]["fc1.weight"]["pieces"][0]
    from shardzoo.checkpoint.safetensors_io import read_header

    header, data_start = read_header(shard_path(ckpt))
    at = data_start + header[piece["key"]]["data_offsets"][0] + 5
    with open(shard_path(ckpt), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"piece 'model/fc1.weight@0,0' of tensor 'fc1.weight' fails its crc32 check"):
        checkpoint.load(serial_stack(0), ckpt)
    target = serial_stack(0)
    checkpoint.load(target, ckpt, verify_checksums=False)  # the caller's choice: sizes only
    with pytest.raises(CheckpointError, match="fc1.weight"):
        checkpoint.export_plain(ckpt, ckpt + "-out", progress=False)


def test_missing_file(saved):
    ckpt, _ = saved
    os.remove(shard_path(ckpt))
    with pytest.raises(CheckpointError, match=r"shard-00000.safetensors is missing; the index stores pieces of 7 tensor"):
        checkpoint.load(serial_stack(0), ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(serial_stack(0), str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="has no index.json"):
        checkpoint.load(serial_stack(0), str(tmp_path))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not a shardzoo checkpoint"):
        checkpoint.save(serial_stack(0), str(tmp_path))  # never replaces a directory it did not write
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_index_does_not_match_model(saved):
    ckpt, model = saved
    wrong_shape = Stack(nn.Embedding(13, 8), nn.LayerNorm(8), nn.Linear(8, 17), nn.Linear(17, 8))
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(wrong_shape, ckpt)
    assert "'fc1.weight' has global shape [16, 8] in the checkpoint but [17, 8] in the model" in str(e.value)
    assert "'fc2.weight' has global shape [8, 16] in the checkpoint but [8, 17] in the model" in str(e.value)

    extra = serial_stack(0)
    extra.head = nn.Linear(8, 3)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(2\): head.bias, head.weight"):
        checkpoint.load(extra, ckpt)
    result = checkpoint.load(extra, ckpt, strict=False)
    assert result == checkpoint.LoadResult(["head.bias", "head.weight"], [])
    assert torch.equal(extra.fc1.weight, model.fc1.weight)

    fewer = serial_stack(0)
    fewer.fc2 = nn.Identity()
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model \(2\): fc2.weight, fc2.bias"):
        checkpoint.load(fewer, ckpt)


def test_file_from_another_checkpoint(saved, tmp_path):
    ckpt, _ = saved
    other = str(tmp_path / "other")
    bigger = Stack(nn.Embedding(13, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8, bias=False))
    checkpoint.save(bigger, other)
    shutil.copy(shard_path(other), shard_path(ckpt))
    with pytest.raises(CheckpointError, match="shard-00000.safetensors is .* bytes but the index records"):
        checkpoint.load(serial_stack(0), ckpt)


def test_interrupted_save_keeps_previous(tmp_path):
    """Rank 2 of 4 fails while writing: every rank raises, the old checkpoint still loads and
    no directory that looks like a checkpoint is left behind."""
    ckpt = str(tmp_path / "ckpt")
    run("2d", save_stack, 1, ckpt)
    before = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointError, match=r"\[rank 2\] OSError: simulated disk failure"):
        run("2d", save_failing_on, 2, ckpt, 2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and sorted(os.listdir(ckpt)) == before
    run("1d_tp2", load_stack, ckpt, 1)  # the previous checkpoint, intact
    # a temp dir of a save that died (marked, no process holds its lock) is cleaned by the next
    # save; directories of the same pattern that no save marked are the user's and stay
    from shardzoo.checkpoint.atomic import MARKER

    os.makedirs(ckpt + ".tmp-0123456789ab")
    (tmp_path / "ckpt.tmp-0123456789ab" / MARKER).write_bytes(b"")
    (tmp_path / "ckpt.tmp-0123456789ab" / "shard-00000.safetensors").write_bytes(b"partial")
    os.makedirs(ckpt + ".tmp-deadbeef")
    run("2d", save_stack, 2, ckpt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.tmp-deadbeef"]
    run("2d", load_stack, ckpt, 2)


def test_corruption_raises_on_every_rank(tmp_path):
    """The rank that checksums the bad piece reports it; all ranks raise the same error."""
    ckpt = str(tmp_path / "ckpt")
    run("2d", save_stack, 4, ckpt)
    index = json.load(open(os.path.join(ckpt, "index.json")))
    index["tensors"]["fc2.weight"]["pieces"][3]["crc32"] ^= 1
    json.dump(index, open(os.path.join(ckpt, "index.json"), "w"))
    messages = run("1d_tp2", load_error, ckpt)
    assert len(set(messages)) == 1 and "tensor 'fc2.weight' fails its crc32 check" in messages[0], messages
