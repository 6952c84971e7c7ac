"""A parallelized transformers model saves a resharding checkpoint: saved in 1d with its kv heads
replicated over tp, loaded into the 2d layout, it holds exactly the serial weights. ``shardzoo
convert`` (default ``--names hf``) of such a checkpoint writes a directory transformers loads
with the serial weights, GPT-2's ``c_attn`` (stored as [in, 3, n]) in its own [in, 3 n] shape;
``checkpoint.load`` into the unsplit model gives the same."""

import copy

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks


def _save_1d_load_2d(ckpt_dir, gpt2_dir):
    import shardzoo
    from shardzoo import checkpoint
    from support.hf_parallel import tiny_causal_lm

    serial = tiny_causal_lm("llama")
    checkpoint.save(shardzoo.parallelize(copy.deepcopy(serial), cached_mesh(tp=4)), ckpt_dir)
    other = shardzoo.parallelize(tiny_causal_lm("llama", seed=5), cached_mesh(tp=4, tp_mode="2d"))
    checkpoint.load(other, ckpt_dir)
    full = shardzoo.full_state_dict(other)
    for name, value in serial.state_dict().items():
        assert torch.equal(full[name], value), name
    checkpoint.save(shardzoo.parallelize(tiny_causal_lm("gpt2"), cached_mesh(tp=4, tp_mode="2d")), gpt2_dir)


def _convert_and_compare(kind: str, ckpt_dir: str, out_dir: str) -> None:
    from shardzoo.cli import main
    from support.hf_parallel import tiny_causal_lm

    assert main(["convert", ckpt_dir, out_dir, "--no-progress"]) == 0
    serial = tiny_causal_lm(kind)
    loaded = type(serial).from_pretrained(out_dir)
    got = loaded.state_dict()
    for name, value in serial.state_dict().items():
        assert torch.equal(got[name], value), name


def _load_into_serial(kind: str, ckpt_dir: str) -> None:
    """The checkpoint of the split model loads into the unsplit one (one process, no group)."""
    from shardzoo import checkpoint
    from support.hf_parallel import tiny_causal_lm

    serial, fresh = tiny_causal_lm(kind), tiny_causal_lm(kind, seed=7)
    checkpoint.load(fresh, ckpt_dir)
    got = fresh.state_dict()
    for name, value in serial.state_dict().items():
        assert torch.equal(got[name], value), name


def test_checkpoint_reshards_between_layouts_and_converts(tmp_path):
    pytest.importorskip("transformers", reason="builds transformers Llama and GPT-2 models")
    llama, gpt2 = str(tmp_path / "llama"), str(tmp_path / "gpt2")
    run_on_ranks(_save_1d_load_2d, 4, llama, gpt2)
    _convert_and_compare("llama", llama, str(tmp_path / "llama-hf"))
    _convert_and_compare("gpt2", gpt2, str(tmp_path / "gpt2-hf"))
    _load_into_serial("gpt2", gpt2)
    _load_into_serial("llama", llama)
