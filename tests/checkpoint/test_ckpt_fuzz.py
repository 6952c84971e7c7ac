"""Property-based fuzzing of every reader (load, export_plain, read_header, Hugging Face weights
and config.json) on damaged copies of real saved files. Every case ends in CheckpointError
naming the file (never another exception type, never a foreign error wrapped into one), or in
a load equal to what was saved (for Hugging Face files: equal to what safetensors itself reads);
no reader allocates more than the files hold. SHARDZOO_FUZZ_EXAMPLES sets the examples per test
(default 50: 300 cases in all); a few multi-rank cases run end to end."""

import contextlib
import json
import math
import os
import re
import shutil
import struct
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardzoo import checkpoint
from shardzoo.checkpoint import CheckpointError, export_plain
from shardzoo.checkpoint.hf_files import HFWeights
from shardzoo.checkpoint.safetensors_io import read_header
from shardzoo.models.spec import spec_named
from shardzoo.models.pretrained import config_from_dir
from shardzoo.testing import run_on_ranks
from support.checkpoint_stack import hf_load_error, load_outcome, run, save_stack, serial_stack, tiny_gpt2_export
from support.fuzz_cases import damaged_bytes, damaged_header, damaged_json, join, split

SEED = 6
FUZZ = settings(max_examples=int(os.environ.get("SHARDZOO_FUZZ_EXAMPLES", "50")), deadline=None,
                suppress_health_check=list(HealthCheck))
FOREIGN = re.compile(r"\b(?!Checkpoint)[A-Z][A-Za-z]*(Error|Exception|Warning): ")  # describe() of another type


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The files of a checkpoint saved on 2 ranks (two shard files, pieces split along dim 0 and 1)."""
    ckpt = str(tmp_path_factory.mktemp("fuzz") / "ckpt")
    run("1d_tp2", save_stack, SEED, ckpt)
    return {n: open(os.path.join(ckpt, n), "rb").read() for n in os.listdir(ckpt)}


@contextlib.contextmanager
def materialised(files: dict[str, bytes]):
    with tempfile.TemporaryDirectory() as d:
        for name, raw in files.items():
            open(os.path.join(d, name), "wb").write(raw)
        yield d


@contextlib.contextmanager
def bounded_allocations(limit: int):
    """torch.empty / torch.zeros (off the meta device) must not ask for more than ``limit`` bytes.
    (Also: fsync is skipped, it is the writer's business and costs a disk flush per example.)"""
    real = {name: getattr(torch, name) for name in ("empty", "zeros")}
    real_fsync = os.fsync

    def guard(name):
        def alloc(*size, **kwargs):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            if str(kwargs.get("device", "cpu")) != "meta" and all(isinstance(s, int) for s in shape):
                item = real["empty"]((), dtype=kwargs.get("dtype") or torch.get_default_dtype()).element_size()
                assert math.prod(shape) * item <= limit, f"torch.{name}{tuple(shape)} allocates more than the files hold"
            return real[name](*size, **kwargs)
        return alloc

    try:
        for name in real:
            setattr(torch, name, guard(name))
        os.fsync = lambda fd: None
        yield
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)
        os.fsync = real_fsync


def attempt(fn, directory: str):
    """``fn()``, or None when it raised a CheckpointError that names a file in ``directory``
    and is no other exception type described in words."""
    try:
        return fn()
    except CheckpointError as e:
        message = str(e)
        assert directory in message, message
        assert not FOREIGN.search(message), message
        return None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_checkpoint(files: dict[str, bytes], data_intact: bool) -> None:
    """Every checkpoint reader on ``files``: an error naming the file, or the saved values."""
    ref = serial_stack(SEED).state_dict()
    models = [serial_stack(0), serial_stack(0)]
    with materialised(files) as ckpt, bounded_allocations(sum(map(len, files.values())) + 4096):
        if attempt(lambda: checkpoint.load(models[0], ckpt), ckpt) is not None:
            assert all(torch.equal(v, ref[k]) for k, v in models[0].state_dict().items()), "loaded wrong values"
        if attempt(lambda: checkpoint.load(models[1], ckpt, verify_checksums=False), ckpt) is not None and data_intact:
            assert all(torch.equal(v, ref[k]) for k, v in models[1].state_dict().items()), "loaded wrong values"
        out = os.path.join(ckpt, "out")
        if attempt(lambda: export_plain(ckpt, out, progress=False), ckpt) is not None:
            got = load_file(os.path.join(out, "model.safetensors"))
            assert got.keys() == ref.keys() and all(torch.equal(got[k], v) for k, v in ref.items()), "exported wrong values"
        for name in files:
            if name.endswith(".safetensors") and attempt(lambda: read_header(os.path.join(ckpt, name)), ckpt) is not None:
                with safe_open(os.path.join(ckpt, name), framework="pt") as f:  # what we accept, safetensors accepts
                    f.keys()


def with_size(files: dict[str, bytes], name: str, raw: bytes, fix_size: bool) -> dict[str, bytes]:
    """``files`` with ``name`` replaced by ``raw``; with ``fix_size`` index.json records its new size."""
    out = {**files, name: raw}
    if fix_size:
        index = json.loads(files["index.json"])
        index["files"][name]["bytes"] = len(raw)
        out["index.json"] = json.dumps(index).encode()
    return out


SHARDS = st.sampled_from(["shard-00000.safetensors", "shard-00001.safetensors"])


@FUZZ
@given(data=st.data(), name=SHARDS, fix_size=st.booleans())
def test_fuzz_shard_bytes(saved, data, name, fix_size):
    raw = data.draw(damaged_bytes(saved[name]))
    check_checkpoint(with_size(saved, name, raw, fix_size), data_intact=False)


@FUZZ
@given(data=st.data(), name=SHARDS)
def test_fuzz_shard_headers(saved, data, name):
    raw = data.draw(damaged_header(saved[name]))
    check_checkpoint(with_size(saved, name, raw, fix_size=True), data_intact=False)


@FUZZ
@given(data=st.data())
def test_fuzz_index(saved, data):
    index = data.draw(damaged_json(json.loads(saved["index.json"])))
    check_checkpoint({**saved, "index.json": json.dumps(index).encode()}, data_intact=True)


@FUZZ
@given(data=st.data())
def test_fuzz_index_bytes(saved, data):
    check_checkpoint({**saved, "index.json": data.draw(damaged_bytes(saved["index.json"]))}, data_intact=True)


# -- Hugging Face directories ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_files():
    """A GPT-2 style directory: config.json and two weight files with their index."""
    gen = torch.Generator().manual_seed(0)
    state = {"transformer.wte.weight": torch.randn(11, 8, generator=gen), "transformer.wpe.weight": torch.randn(6, 8, generator=gen),
             "transformer.ln_f.bias": torch.randn(8, generator=gen).half()}
    config = {"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1, "vocab_size": 11, "n_positions": 6,
              "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "n_inner": None, "tie_word_embeddings": True}
    with tempfile.TemporaryDirectory() as d:
        save_file({k: state[k] for k in list(state)[:2]}, os.path.join(d, "a.safetensors"))
        save_file({k: state[k] for k in list(state)[2:]}, os.path.join(d, "b.safetensors"))
        files = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}
    files["model.safetensors.index.json"] = json.dumps({"metadata": {"total_size": 0}, "weight_map": {
        k: "a.safetensors" if i < 2 else "b.safetensors" for i, k in enumerate(state)}}).encode()
    files["config.json"] = json.dumps(config).encode()
    return files


def check_hf(files: dict[str, bytes]) -> None:
    """HFWeights and config_from_dir: an error naming the file, or what safetensors reads."""
    with materialised(files) as d, bounded_allocations(sum(map(len, files.values())) + 4096):
        weights = attempt(lambda: HFWeights(d), d)
        for key in (weights.entries if weights is not None else {}):
            shape = weights.shape(key)
            got = attempt(lambda: weights.read(key, ((0,) * len(shape), shape)), d)
            if got is not None:
                with safe_open(weights.path(key), framework="pt") as f:
                    assert same_bytes(got, f.get_tensor(key)), key
        config = attempt(lambda: config_from_dir(spec_named("gpt2"), d), d)
        assert config is None or isinstance(config.n_head, int) and not isinstance(config.n_head, bool)


HF_FILES = st.sampled_from(["a.safetensors", "b.safetensors", "model.safetensors"])


@FUZZ
@given(data=st.data(), name=HF_FILES, header=st.booleans())
def test_fuzz_hf_weight_files(hf_files, data, name, header):
    """One of the sharded directory's files, or the only file of a single-file directory."""
    files = hf_files if name != "model.safetensors" else {"config.json": hf_files["config.json"],
                                                          name: hf_files["a.safetensors"]}
    raw = data.draw(damaged_header(files[name]) if header else damaged_bytes(files[name]))
    check_hf({**files, name: raw})


@FUZZ
@given(data=st.data(), name=st.sampled_from(["model.safetensors.index.json", "config.json"]))
def test_fuzz_hf_json(hf_files, data, name):
    doc = data.draw(damaged_json(json.loads(hf_files[name])))
    check_hf({**hf_files, name: json.dumps(doc).encode()})


# -- multi-rank, end to end --------------------------------------------------------------------
def test_damaged_checkpoint_fails_alike_on_every_rank(saved, tmp_path):
    """A few damages, loaded on 2 ranks (with and without checksums): every rank reports the
    same CheckpointError naming the file."""
    n, header, data = split(saved["shard-00001.safetensors"])
    key = sorted(k for k in header if k != "__metadata__")[0]
    flipped = bytearray(saved["shard-00001.safetensors"])
    flipped[-1] ^= 0x10
    retyped = {**header, key: {**header[key], "dtype": "I32"}}
    index = json.loads(saved["index.json"])
    cases = {
        "bit flip": ({**saved, "shard-00001.safetensors": bytes(flipped)}, [True], "fails its crc32 check"),
        "header length near 2**64": ({**saved, "shard-00001.safetensors": struct.pack("<Q", 2**64 - 9) + bytes(flipped[8:])},
                                     [True, False], "header length field is above the safetensors limit"),
        "dtype in the header": (with_size(saved, "shard-00001.safetensors", join(retyped, data), True), [True, False],
                                "has another dtype in the file than in the index"),
        "tensors as a list": ({**saved, "index.json": json.dumps({**index, "tensors": list(index["tensors"].values())}).encode()},
                              [True, False], "tensors: must be an object, is an array"),
    }
    for what, (files, verifies, needle) in cases.items():
        ckpt = str(tmp_path / what.replace(" ", "-").replace("*", ""))
        os.makedirs(ckpt)
        for name, raw in files.items():
            open(os.path.join(ckpt, name), "wb").write(raw)
        for verify in verifies:
            outcomes = run("1d_tp2", load_outcome, ckpt, SEED, verify)
            assert len(set(outcomes)) == 1 and outcomes[0][0] == "error", (what, outcomes)
            assert needle in outcomes[0][1] and ckpt in outcomes[0][1], (what, outcomes[0][1])


def test_damaged_hf_directory_fails_alike_on_every_rank(tmp_path):
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    run_on_ranks(tiny_gpt2_export, 2, hf, ckpt)
    assert run_on_ranks(hf_load_error, 2, hf) == ["", ""]  # intact, it loads
    config = json.load(open(os.path.join(hf, "config.json")))
    for edit, needle in ((dict(n_head="2"), "field n_head must be an integer, is a string"),
                         (dict(n_embd=2**40), "field n_embd must be between 1 and")):
        json.dump({**config, **edit}, open(os.path.join(hf, "config.json"), "w"))
        messages = run_on_ranks(hf_load_error, 2, hf)
        assert len(set(messages)) == 1 and needle in messages[0] and "config.json" in messages[0], messages
    json.dump(config, open(os.path.join(hf, "config.json"), "w"))
    weights = os.path.join(hf, "model.safetensors")
    shutil.move(weights, tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", weights)
    messages = run_on_ranks(hf_load_error, 2, hf)
    assert len(set(messages)) == 1 and "is a symlink whose target lies outside" in messages[0], messages
