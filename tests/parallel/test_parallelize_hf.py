"""transformers causal LMs (Llama with grouped-query attention, Qwen2 with tied embeddings and
q / k / v biases, Mistral, OLMo2 with q / k norms over every head, GPT-2 with Conv1D weights and
q|k|v packed in c_attn) run by their own code after ``shardzoo.parallelize``: loss, logits
and every parameter after one optimizer step equal the serial transformers model in fp32, with
padding, in every layout, with sequence parallelism and with ZeRO 1, 2 and 3 on dp."""

import pytest

pytest.importorskip("transformers", reason="transformers is in the test extra; these tests build its models")

from shardzoo.testing import run_on_ranks  # noqa: E402
from support.hf_parallel import check_against_serial, check_packed  # noqa: E402

import torch  # noqa: E402

# (model, ParallelMesh kwargs, world, sp_mode, zero[, dtype])
CASES = {
    "llama-1d-tp4-kv-replicated": ("llama", dict(tp=4), 4, "ring", 0),
    "llama-1d-tp8-kv-replicated": ("llama", dict(tp=8), 8, "ring", 0),
    "llama-2d": ("llama", dict(tp=4, tp_mode="2d"), 4, "ring", 0),
    "qwen2-2.5d-depth2": ("qwen2", dict(tp=8, tp_mode="2.5d", tp_depth=2), 8, "ring", 0),
    "mistral-3d": ("mistral", dict(tp=8, tp_mode="3d"), 8, "ring", 0),
    "qwen2-1d-sp2-ring": ("qwen2", dict(tp=2, sp=2), 4, "ring", 0),
    "mistral-1d-sp2-ulysses": ("mistral", dict(tp=2, sp=2), 4, "ulysses", 0),
    "qwen2-dp2-zero1": ("qwen2", dict(dp=2, tp=2), 4, "ring", 1),
    "gpt2-dp2-zero2": ("gpt2", dict(dp=2, tp=2), 4, "ring", 2),
    "llama-dp2-zero3": ("llama", dict(dp=2, tp=2), 4, "ring", 3),
    "gpt2-1d-tp4": ("gpt2", dict(tp=4), 4, "ring", 0),
    "gpt2-3d": ("gpt2", dict(tp=8, tp_mode="3d"), 8, "ring", 0),
    "gpt2-2d-sp2": ("gpt2", dict(tp=4, tp_mode="2d", sp=2), 8, "ring", 0),
    # its own plan gathers q, k, v for the norms; completed, they are 'column_norm' over the split width
    "olmo2-1d-dp2-tp2": ("olmo2", dict(dp=2, tp=2), 4, "ring", 0),
    "olmo2-2d": ("olmo2", dict(tp=4, tp_mode="2d"), 4, "ring", 0),
    "llama-1d-tp4-bf16": ("llama", dict(tp=4), 4, "ring", 0, torch.bfloat16),
    "qwen2-2d-bf16": ("qwen2", dict(tp=4, tp_mode="2d"), 4, "ring", 0, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_model_equals_serial(case):
    run_on_ranks(check_against_serial, CASES[case][2], *CASES[case][:2], *CASES[case][3:])


# (model, ParallelMesh kwargs, world, zero or None: no data_parallel wrapper)
SP_GRADIENTS = {
    "llama-tp2-sp2-unwrapped": ("llama", dict(tp=2, sp=2), 4, None),
    "gpt2-tp2-sp2-unwrapped": ("gpt2", dict(tp=2, sp=2), 4, None),
    "gpt2-dp2-sp2-ddp": ("gpt2", dict(dp=2, sp=2), 4, 0),
    "llama-dp2-sp2-zero2": ("llama", dict(dp=2, sp=2), 4, 2),
}


@pytest.mark.parametrize("case", list(SP_GRADIENTS))
def test_gradients_are_summed_over_sp_by_backward(case):
    """The gradients are right after ``loss.backward()`` for every axis parallelize split, with no
    wrapper to remember; ``data_parallel`` then adds dp only (sp is not summed a second time)."""
    kind, mesh_kwargs, world, zero = SP_GRADIENTS[case]
    run_on_ranks(check_against_serial, world, kind, mesh_kwargs, "ring", zero or 0, torch.float32, zero is not None)


def _plan_without_embedding(kind: str) -> dict:
    """transformers' own plan for the blocks and the head, the norms as 'sequence_parallel':
    no entry for the token embedding."""
    from support.hf_parallel import tiny_causal_lm

    model = tiny_causal_lm(kind)
    norms = {"layers.*.input_layernorm", "layers.*.post_attention_layernorm", "norm"}
    return {**model.config.base_model_tp_plan, **type(model)._tp_plan, **dict.fromkeys(norms, "sequence_parallel")}


@pytest.mark.parametrize("mesh_kwargs, world", [(dict(tp=2), 2), (dict(tp=2, sp=2), 4)])
def test_plan_without_the_embedding_keeps_it_whole_in_1d(mesh_kwargs, world):
    """In 1d the token embedding reads whole token ids on every tp rank: unplanned, it is kept
    whole, and the model equals serial (loss, logits, every weight after a step)."""
    run_on_ranks(check_against_serial, world, "llama", mesh_kwargs, "ring", 0, torch.float32, True,
                 _plan_without_embedding("llama"))


@pytest.mark.parametrize("sp_mode", ["ring", "ulysses"])
def test_packed_documents_equal_documents_one_by_one(sp_mode):
    """transformers' packed format through a parallelized Llama at tp=2, sp=2."""
    run_on_ranks(check_packed, 4, "llama", dict(tp=2, sp=2), sp_mode)
