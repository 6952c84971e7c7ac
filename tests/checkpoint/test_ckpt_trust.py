"""Files are untrusted input: names read from disk never leave their directory (``..``, absolute
paths, symlinks), wrong-typed JSON and crafted headers end in CheckpointError naming the file
and the rule, never quoting the file, and save / export touch only what they wrote."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from shardzoo import checkpoint
from shardzoo.checkpoint import CheckpointError, export_plain
from shardzoo.checkpoint.hf_files import HFWeights
from shardzoo.models.spec import spec_named
from shardzoo.models.pretrained import config_from_dir
from support.checkpoint_stack import load_error, run, save_stack, serial_stack

SHARD = "shard-00000.safetensors"


@pytest.fixture
def saved(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(serial_stack(5), ckpt, config={"hidden_size": 8})
    return ckpt


def edit_index(ckpt, edit):
    path = os.path.join(ckpt, "index.json")
    index = json.load(open(path))
    edit(index)
    json.dump(index, open(path, "w"))


def rename_shard_in_index(index, new):
    index["files"] = {new: next(iter(index["files"].values()))}
    for entry in index["tensors"].values():
        for piece in entry["pieces"]:
            piece["file"] = new


def both_readers_refuse(ckpt, *needles):
    """load (with and without checksums) and export raise CheckpointError containing ``needles``."""
    for read in (lambda: checkpoint.load(serial_stack(0), ckpt), lambda: checkpoint.load(serial_stack(0), ckpt, verify_checksums=False),
                 lambda: export_plain(ckpt, ckpt + "-out", progress=False)):
        with pytest.raises(CheckpointError) as info:
            read()
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))


def test_index_naming_a_file_outside_is_refused(saved, tmp_path):
    """The shard moved one level up and the index pointed at it: refused, naming index.json,
    the entry and the rule; so is an absolute path to it and a separator inside the directory."""
    shutil.move(os.path.join(saved, SHARD), tmp_path / "outside.safetensors")
    edit_index(saved, lambda index: rename_shard_in_index(index, "../outside.safetensors"))
    both_readers_refuse(saved, "index.json, files", "'../outside.safetensors'", "contains a path separator")
    edit_index(saved, lambda index: rename_shard_in_index(index, str(tmp_path / "outside.safetensors")))
    both_readers_refuse(saved, "index.json, files", "is an absolute path")
    edit_index(saved, lambda index: rename_shard_in_index(index, ".."))
    both_readers_refuse(saved, "index.json, files", "is not a file name")


def test_symlinks_out_of_the_directory_are_refused(saved, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(os.path.join(saved, SHARD), outside)
    os.symlink(outside, os.path.join(saved, SHARD))
    both_readers_refuse(saved, f"{os.path.join(saved, SHARD)} is a symlink whose target lies outside")
    os.unlink(os.path.join(saved, SHARD))  # a link to a file inside the directory is fine
    shutil.move(outside, os.path.join(saved, "real.safetensors"))
    os.symlink("real.safetensors", os.path.join(saved, SHARD))
    checkpoint.load(serial_stack(0), saved)
    index_link = tmp_path / "elsewhere.json"  # index.json itself may not point out either
    shutil.move(os.path.join(saved, "index.json"), index_link)
    os.symlink(index_link, os.path.join(saved, "index.json"))
    both_readers_refuse(saved, "index.json is a symlink whose target lies outside")


@pytest.mark.parametrize("edit, needles", [
    (lambda ix: ix.update(tensors=list(ix["tensors"].values())), ["index.json, tensors: must be an object, is an array"]),
    (lambda ix: ix["tensors"]["fc1.weight"].update(shape="16x8"), ["tensors['fc1.weight'].shape: must be an array"]),
    (lambda ix: ix["tensors"]["fc1.weight"]["pieces"][0].pop("crc32"), ["pieces[0]: lacks the field(s) crc32"]),
    (lambda ix: ix["tensors"]["fc1.weight"]["pieces"][0].update(extra=1), ["pieces[0]: has 1 unknown field(s)"]),
    (lambda ix: ix["tensors"]["fc1.weight"].update(dtype="float128"), ["tensors['fc1.weight'].dtype: must name a dtype"]),
    (lambda ix: ix["tensors"]["fc1.weight"].update(serial_shape=[16, 9]), ["serial_shape: must hold as many elements"]),
    (lambda ix: ix["tensors"]["fc1.weight"].update(serial_shape="128"), ["serial_shape: must be an array"]),
    (lambda ix: ix["tensors"]["fc1.weight"].update(shape=[2**40, 2**40]), ["tensors['fc1.weight'].shape: describes more than"]),
    (lambda ix: ix["tensors"]["fc1.weight"]["pieces"][0].update(offsets=[-8, 0]), ["offsets[0]: must be between 0"]),
    (lambda ix: ix["files"][SHARD].update(bytes=True), ["files['shard-00000.safetensors'].bytes: must be an integer"]),
    (lambda ix: ix.update(version="1"), ["index.json, version: must be an integer, is a string"]),
    (lambda ix: ix.pop("files"), ["lacks the field(s) files"]),
])
def test_wrong_typed_index_fields_are_named(saved, edit, needles):
    edit_index(saved, edit)
    both_readers_refuse(saved, os.path.join(saved, "index.json"), *needles)


def two_piece_checkpoint(tmp_path):
    """fc1.weight [16, 8] saved on 2 ranks: pieces at rows 0 and 8."""
    ckpt = str(tmp_path / "two")
    run("1d_tp2", save_stack, 3, ckpt)
    return ckpt


@pytest.mark.parametrize("offsets, rule", [
    ([[0, 0], [4, 0]], "overlap"), ([[8, 0], [0, 0]], "is not the key this piece is saved under"),
    ([[0, 0], [9, 0]], "lies (partly) outside the tensor's global shape"), ([[0, 0], [-8, 0]], "must be between 0"),
])
def test_export_refuses_overlapping_reversed_negative_offsets(tmp_path, offsets, rule):
    ckpt = two_piece_checkpoint(tmp_path)

    def edit(index):
        pieces = index["tensors"]["fc1.weight"]["pieces"]
        for piece, new in zip(pieces, offsets):
            piece["offsets"] = new
            if rule == "overlap":  # keys as save writes them, so only the overlap is wrong
                piece["key"] = f"model/fc1.weight@{new[0]},{new[1]}"
    edit_index(ckpt, edit)
    with pytest.raises(CheckpointError, match="fc1.weight"):
        export_plain(ckpt, str(tmp_path / "out"), progress=False)
    with pytest.raises(CheckpointError) as info:
        export_plain(ckpt, str(tmp_path / "out"), progress=False)
    assert rule in str(info.value) and "index.json" in str(info.value)
    assert not os.path.exists(tmp_path / "out" / "config.json")


def test_header_check_runs_without_checksums(saved):
    """F32 -> I32 in a piece's header entry (size and index untouched) is refused by
    load(verify_checksums=False) too, naming file and piece, never loaded as garbage."""
    path = os.path.join(saved, SHARD)
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    key = "model/fc1.weight@0,0"
    at = 8 + raw[8:8 + n].index(json.dumps(key).encode()) + len(json.dumps(key)) + 1
    at = raw.index(b'"F32"', at)
    assert header[key]["dtype"] == "F32"
    open(path, "wb").write(raw[:at] + b'"I32"' + raw[at + 5:])
    with pytest.raises(CheckpointError, match=r"piece 'model/fc1.weight@0,0' of tensor 'fc1.weight' has another dtype"):
        checkpoint.load(serial_stack(0), saved, verify_checksums=False)


def test_errors_do_not_quote_the_file(saved, tmp_path):
    """A text file where a shard should be: the message names file and rule, not its bytes
    (the header length field read from it is not echoed either)."""
    secret = b"root:x:0:0:SECRET-CONTENT:/root:/bin/bash\n" * 50
    path = os.path.join(saved, SHARD)
    open(path, "wb").write(secret)
    edit_index(saved, lambda index: index["files"][SHARD].update(bytes=len(secret)))
    for verify in (True, False):
        message = load_error_here(saved, verify)
        assert "header length field is above the safetensors limit" in message and SHARD in message
        assert "SECRET" not in message and str(struct.unpack("<Q", secret[:8])[0]) not in message


def load_error_here(ckpt, verify):
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(serial_stack(0), ckpt, verify_checksums=verify)
    return str(info.value)


def test_export_never_writes_through_planted_symlinks(saved, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("model.safetensors", "config.json", "model.safetensors.partial",
                                                                "config.json.partial")}
    for name, victim in victims.items():
        victim.write_text("keep me")
        os.symlink(victim, out / name)
    export_plain(saved, str(out), progress=False)
    assert all(v.read_text() == "keep me" for v in victims.values())
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not any(os.path.islink(out / n) for n in os.listdir(out))


def test_save_touches_only_directories_it_marked(tmp_path):
    """A user's step.old-manual-backup / step.tmp-notes survive saves; with step absent a
    user's step.old-keep (holding an index.json) is neither moved to step nor overwritten."""
    step = str(tmp_path / "step")
    for name in ("step.old-manual-backup", "step.tmp-notes", "step.old-keep", "step.old-0123456789ab"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "index.json").write_text("{}")
        (tmp_path / name / "mine.txt").write_text("mine")
    checkpoint.save(serial_stack(1), step)
    checkpoint.save(serial_stack(2), step)
    assert sorted(os.listdir(tmp_path)) == ["step", "step.old-0123456789ab", "step.old-keep", "step.old-manual-backup",
                                            "step.tmp-notes"]
    assert all((tmp_path / n / "mine.txt").read_text() == "mine" for n in os.listdir(tmp_path) if n != "step")
    model = serial_stack(0)
    checkpoint.load(model, step)
    assert torch.equal(model.fc1.weight, serial_stack(2).fc1.weight)


def test_second_save_into_the_same_directory_is_refused_while_one_runs(saved):
    """A save that is running holds the lock of its temp dir: another save into the same
    directory is refused; once the first ends (here: its process died) the next save cleans up."""
    from shardzoo.checkpoint import atomic

    running = atomic.prepare(saved, "0123456789ab")
    try:
        with pytest.raises(CheckpointError, match="another save into .* is running"):
            checkpoint.save(serial_stack(9), saved)
        checkpoint.load(serial_stack(0), saved)  # the previous checkpoint is untouched
    finally:
        running.release()  # what a process's death does: the lock goes, the directory stays
    checkpoint.save(serial_stack(9), saved)
    assert sorted(os.listdir(os.path.dirname(saved))) == ["ckpt"]


# -- Hugging Face directories ------------------------------------------------------------------
def hf_dir(tmp_path, sharded=False):
    """A tiny GPT-2 layout: config.json and one file (or two plus the index)."""
    d = tmp_path / "hf"
    d.mkdir()
    state = {"transformer.wte.weight": torch.randn(11, 8), "transformer.wpe.weight": torch.randn(6, 8)}
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1,
                                                "vocab_size": 11, "n_positions": 6}))
    if not sharded:
        save_file(state, str(d / "model.safetensors"))
        return str(d)
    weight_map = {}
    for i, (key, t) in enumerate(state.items()):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({key: t}, str(d / name))
        weight_map[key] = name
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(d)


def test_hf_index_naming_a_file_outside_is_refused(tmp_path):
    d = hf_dir(tmp_path, sharded=True)
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shutil.move(os.path.join(d, "model-00001-of-00002.safetensors"), tmp_path / "outside.safetensors")
    index["weight_map"]["transformer.wte.weight"] = "../outside.safetensors"
    json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json, weight_map\['transformer.wte.weight'\]: "
                                              r"file name '../outside.safetensors' contains a path separator"):
        HFWeights(d)
    index["weight_map"] = ["not", "an", "object"]
    json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError, match="weight_map: must be an object, is an array"):
        HFWeights(d)


def test_hf_symlinks_out_are_refused_except_into_the_hub_cache_blobs(tmp_path):
    d = hf_dir(tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(os.path.join(d, "model.safetensors"), outside)
    os.symlink(outside, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors is a symlink whose target lies outside"):
        HFWeights(d)
    # the hub cache: snapshots/<revision>/model.safetensors -> ../../blobs/<hash>
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    shutil.move(outside, repo / "blobs" / "0f0f")
    os.symlink("../../blobs/0f0f", repo / "snapshots" / "abc123" / "model.safetensors")
    assert sorted(HFWeights(str(repo / "snapshots" / "abc123")).entries) == ["transformer.wpe.weight", "transformer.wte.weight"]


@pytest.mark.parametrize("config, needle", [
    ({"model_type": "gpt2", "n_head": "2"}, "config.json: field n_head must be an integer, is a string"),
    (["gpt2"], "config.json: must be an object, is an array"),
    ({"model_type": "gpt2", "n_embd": -8}, "config.json: field n_embd must be between 1 and"),
    ({"model_type": "gpt2", "resid_pdrop": 2.0}, "field resid_pdrop is a probability"),
    ({"model_type": "gpt2", "tie_word_embeddings": "yes"}, "field tie_word_embeddings must be true or false"),
    ({"model_type": ["gpt2"]}, "has a model_type shardzoo does not know"),
])
def test_hf_config_fields_are_checked(tmp_path, config, needle):
    d = hf_dir(tmp_path)
    open(os.path.join(d, "config.json"), "w").write(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        config_from_dir(spec_named("gpt2"), d)
    assert needle in str(info.value) and os.path.join(d, "config.json") in str(info.value)
    open(os.path.join(d, "config.json"), "w").write("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        config_from_dir(spec_named("gpt2"), d)


def test_crafted_shard_fails_the_same_on_every_rank(tmp_path):
    """Two ranks loading a checkpoint whose index points out of the directory raise the same
    CheckpointError."""
    ckpt = two_piece_checkpoint(tmp_path)
    edit_index(ckpt, lambda index: index["files"].update({"/etc/passwd": {"bytes": 8}}))
    messages = run("1d_tp2", load_error, ckpt)
    assert len(set(messages)) == 1 and "is an absolute path" in messages[0], messages


def test_hf_rows_are_read_straight_into_the_parameter_or_not_at_all(tmp_path):
    """The whole-rows read fills ``out`` with exactly the file's rows; any other box or dtype
    reads nothing (the caller then copies through a mapped read); a file cut short while the
    rows are read is named."""
    weights = {"a": torch.arange(60, dtype=torch.float32).reshape(6, 10), "b": torch.ones(3, dtype=torch.bfloat16)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    hf = HFWeights(str(tmp_path))
    out = torch.full((3, 10), -1.0)
    assert hf.read_rows_into("a", ((2, 0), (3, 10)), out)
    assert torch.equal(out, weights["a"][2:5])
    b = torch.zeros(2, dtype=torch.bfloat16)
    assert hf.read_rows_into("b", ((1,), (2,)), b) and torch.equal(b, weights["b"][1:])
    untouched = torch.full((3, 4), -1.0)
    assert not hf.read_rows_into("a", ((2, 3), (3, 4)), untouched)  # part of each row: not one byte range
    assert not hf.read_rows_into("a", ((2, 0), (3, 10)), torch.zeros(3, 10, dtype=torch.bfloat16))  # a cast
    assert not hf.read_rows_into("a", ((0, 0), (6, 10)), torch.zeros(10, 6).t())  # not contiguous
    assert torch.equal(untouched, torch.full((3, 4), -1.0))
    path = tmp_path / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match="became shorter while it was read"):
        hf.read_rows_into("a", ((0, 0), (6, 10)), torch.zeros(6, 10))
