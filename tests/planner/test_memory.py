"""The activation terms of the memory model are the bytes autograd keeps: for one block of each
family in each tp_mode (and sp by ring / Ulysses, with dropout), the saved tensors' storages of
a training forward equal the planner's per-block figure, and the embeddings' too."""

import pytest

from shardzoo.models.spec import spec_named
from shardzoo.planner.enumerate import Problem
from shardzoo.planner.evaluate import Candidate, Pricer
from _measure import saved_bytes
from shardzoo.planner.walked import family_shape
from shardzoo.planner.presets import HARDWARE
from shardzoo.testing import run_on_ranks
from support.family_configs import config_of

CASES = [  # family, ParallelMesh kwargs, sp_mode, dropout
    ("gpt2", dict(tp=8, tp_mode="3d"), "ring", 0.1),
    ("opt", dict(tp=8, tp_mode="2.5d", tp_depth=2), "ring", 0.0),
    ("bert", dict(tp=2, sp=2), "ring", 0.1),
    ("gpt2", dict(tp=2, tp_mode="1d", sp=2), "ulysses", 0.0),
    ("opt", dict(tp=4, tp_mode="2d"), "ring", 0.1),
]


@pytest.mark.parametrize("family,layout,sp_mode,dropout", CASES)
def test_saved_activations_match_the_memory_model(family, layout, sp_mode, dropout):
    kwargs = dict(dp=1, pp=1, sp=1, tp=1, tp_mode="1d", tp_depth=1) | layout
    candidate = Candidate(**kwargs)
    spec = dict(family=family, config=config_of(family, 2, 37, 48, dropout), layout=kwargs, batch=4, seq=8,
                sp_mode=sp_mode)
    measured = run_on_ranks(saved_bytes, candidate.world, spec)
    shape = family_shape(spec_named(family), spec_named(family).config(**spec["config"]))
    cpu_masks = 4  # on CPU a dropout mask is the fp32 noise tensor
    problem = Problem(shape, candidate.world, 4, 8, sp_mode, mask_bytes=cpu_masks)
    stage = Pricer(problem, HARDWARE["a100"]).stages(candidate)[0]
    for rank, got in enumerate(measured):
        assert got["block0"] == got["block1"] == stage.block_saved, (rank, got, stage.block_saved)
        assert got["embed"] == stage.first.saved, (rank, got, stage.first.saved)
        assert abs(got["head"] - stage.last.saved) <= 8, (rank, got, stage.last.saved)  # + the loss's scalars


@pytest.mark.parametrize("layout,sp_mode", [(dict(tp=4), "ring"), (dict(tp=2, sp=2), "ulysses")], ids=["1d-tp4", "ulysses"])
def test_saved_activations_of_a_walked_llama(layout, sp_mode):
    """A transformers Llama with grouped-query attention priced by its modules (planner/walk.py):
    the blocks and the embeddings save what the planner says; the first block also keeps the
    RoPE tables every block reads, which the planner puts with the embeddings."""
    pytest.importorskip("transformers", reason="builds a transformers Llama")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardzoo.planner.walked import walked_model

    config = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=False)
    kwargs = dict(dp=1, pp=1, sp=1, tp=1, tp_mode="1d", tp_depth=1) | layout
    candidate = Candidate(**kwargs)
    spec = dict(hf=dict(model_type="llama", config=config), layout=kwargs, batch=4, seq=8, sp_mode=sp_mode)
    measured = run_on_ranks(saved_bytes, candidate.world, spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config))
    problem = Problem(walked_model(model), candidate.world, 4, 8, sp_mode, mask_bytes=4)
    stage = Pricer(problem, HARDWARE["a100"]).stages(candidate)[0]
    for rank, got in enumerate(measured):
        assert got["block1"] == stage.block_saved, (rank, got, stage.block_saved)
        assert got["embed"] + got["block0"] - got["block1"] == stage.first.saved, (rank, got, stage.first.saved)
        assert abs(got["head"] - stage.last.saved) <= 8, (rank, got, stage.last.saved)  # + the loss's scalars
