"""A model loaded the way users load one (``save_pretrained`` to a directory, then
``shardzoo.from_pretrained``) saves a checkpoint, which loads back with its weights; and
``shardzoo convert`` of a transformers model's checkpoint writes a ``config.json`` with its
``model_type``, so ``AutoModelForCausalLM`` loads the directory with the same weights."""

import json
import os

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks

pytest.importorskip("transformers", reason="reads and writes transformers model directories")


def _load_and_save(model_dir, ckpt_dir, in_process=False):
    import shardzoo
    from shardzoo import checkpoint
    from support.finetune import tiny_llama

    mesh = cached_mesh(tp=2)
    if in_process:  # the same model built from its config (no dtype in it), then split
        model = shardzoo.parallelize(tiny_llama(), mesh)
    else:  # its config carries dtype=torch.float32
        model = shardzoo.from_pretrained(model_dir, mesh)
    checkpoint.save(model, ckpt_dir)


def test_from_pretrained_model_saves_a_checkpoint(tmp_path):
    from shardzoo import checkpoint
    from support.finetune import load_serial, save_tiny_llama, tiny_llama

    model_dir = save_tiny_llama(str(tmp_path / "hf"))
    ckpt = str(tmp_path / "ckpt")
    run_on_ranks(_load_and_save, 2, model_dir, ckpt)
    fresh = tiny_llama(seed=3)
    checkpoint.load(fresh, ckpt)
    expected = load_serial(model_dir).state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("in_process", [False, True], ids=["from_pretrained", "from_config"])
def test_converted_checkpoint_loads_with_auto_class(tmp_path, in_process):
    import transformers

    from shardzoo.cli import main
    from support.finetune import load_serial, save_tiny_llama

    model_dir = save_tiny_llama(str(tmp_path / "hf"))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    run_on_ranks(_load_and_save, 2, model_dir, ckpt, in_process)
    assert main(["convert", ckpt, out, "--no-progress"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    expected, got = load_serial(model_dir).state_dict(), loaded.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
