"""A parallelized transformers model saves a resharding checkpoint: saved in 1d with its kv heads
replicated over tp, loaded into the 2d layout, it holds exactly the serial weights."""

import copy

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks


def _save_1d_load_2d(ckpt_dir):
    import shardzoo
    from shardzoo import checkpoint
    from shardzoo.testing.hf_parallel import tiny_causal_lm

    serial = tiny_causal_lm("llama")
    checkpoint.save(shardzoo.parallelize(copy.deepcopy(serial), cached_mesh(tp=4)), ckpt_dir)
    other = shardzoo.parallelize(tiny_causal_lm("llama", seed=5), cached_mesh(tp=4, tp_mode="2d"))
    checkpoint.load(other, ckpt_dir)
    full = shardzoo.full_state_dict(other)
    for name, value in serial.state_dict().items():
        assert torch.equal(full[name], value), name


def test_checkpoint_reshards_between_layouts(tmp_path):
    pytest.importorskip("transformers", reason="builds a transformers Llama")
    run_on_ranks(_save_1d_load_2d, 4, str(tmp_path / "ckpt"))
