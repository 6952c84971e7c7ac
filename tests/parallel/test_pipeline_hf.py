"""transformers causal LMs cut into pipeline stages by ``shardzoo.parallelize`` and run by
``shardzoo.pipeline`` under every schedule, through their own code: the step's loss on every
rank and every weight after one optimizer step equal the serial model (fp32, padding included),
with 1d (Megatron sequence parallelism on), 2d, sp, dp with ZeRO 1 and 3, uneven stages,
activation checkpointing and bf16 (against the serial bf16 model), and MoE models with their
experts split over ep (ZeRO 0 and 3); each rank holds only its stage's parameters. Dropout draws
its masks in a pipeline and checkpointing replays them. Under Megatron sequence parallelism a
stage sends this tp rank's chunk of the sequence."""

import functools

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the test extra; these tests build its models")

from shardzoo.testing import run_on_ranks  # noqa: E402
from support.hf_pipeline import check_pipeline  # noqa: E402

# (model, ParallelMesh kwargs, world, blocks, schedule, micro-batches, options)
CASES = {
    "llama-gqa-pp2-1d-tp2-1f1b-uneven": ("llama", dict(pp=2, tp=2), 4, 3, "1f1b", 2, dict(stages=[1, 2])),
    "qwen2-tied-pp2-dp2-zero3-gpipe": ("qwen2", dict(pp=2, dp=2), 4, 2, "gpipe", 2, dict(zero=3)),
    "qwen3-pp4-1f1b-uneven": ("qwen3", dict(pp=4), 4, 5, "1f1b", 4, dict(stages=[2, 1, 1, 1])),
    "llama-pp4-zbv-uneven": ("llama", dict(pp=4), 4, 9, "zbv", 4,
                             dict(virtual_stages=2, placement="v", stages=[2, 1, 1, 1, 1, 1, 1, 1])),
    "gpt2-tied-pp2-1d-tp2-zbv-checkpointed": ("gpt2", dict(pp=2, tp=2), 4, 4, "zbv", 2,
                                             dict(virtual_stages=2, placement="v", checkpointing=True)),
    "mistral-pp2-2d-zero-bubble": ("mistral", dict(pp=2, tp=4, tp_mode="2d"), 8, 4, "zero_bubble", 2,
                                   dict(virtual_stages=2)),
    "llama-pp2-sp2-ulysses-interleaved": ("llama", dict(pp=2, sp=2), 4, 4, "interleaved_1f1b", 2,
                                          dict(virtual_stages=2, sp_mode="ulysses")),
    "llama-pp2-dp2-zero1-zero-bubble": ("llama", dict(pp=2, dp=2), 4, 4, "zero_bubble", 2,
                                        dict(zero=1, virtual_stages=2)),
    "gpt2-pp2-tp2-dualpipev": ("gpt2", dict(pp=2, tp=2), 4, 4, "dualpipev", 4, dict(virtual_stages=2, placement="v")),
    "qwen2-tied-pp2-dp2-zero3-zbv": ("qwen2", dict(pp=2, dp=2), 4, 4, "zbv", 2,
                                     dict(zero=3, virtual_stages=2, placement="v")),
    "llama-pp2-dp2-zero2-zero-bubble": ("llama", dict(pp=2, dp=2), 4, 4, "zero_bubble", 2,
                                        dict(zero=2, virtual_stages=2)),
    "llama-pp2-1d-tp2-bf16-1f1b": ("llama", dict(pp=2, tp=2), 4, 2, "1f1b", 2, dict(dtype=torch.bfloat16)),
    # experts split over ep = dp: the stage's DDP (zero 0 / 1) leaves them out, FSDP2 (zero 3) shards them over edp
    "mixtral-pp2-dp2-ep2-zero0-1f1b": ("mixtral", dict(pp=2, dp=2, ep=2), 4, 2, "1f1b", 2, dict(zero=0)),
    "qwen3moe-pp2-dp2-ep2-zero3-1f1b": ("qwen3_moe", dict(pp=2, dp=2, ep=2), 4, 2, "1f1b", 2, dict(zero=3)),
    "mixtral-pp2-dp2-ep2-zero1-zero-bubble": ("mixtral", dict(pp=2, dp=2, ep=2), 4, 4, "zero_bubble", 2,
                                              dict(zero=1, virtual_stages=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_transformers_model_equals_serial(case):
    kind, mesh_kwargs, world, layers, schedule, micro, options = CASES[case]
    run_on_ranks(functools.partial(check_pipeline, **options), world, kind, mesh_kwargs, layers, schedule, micro)


def test_wrong_pipeline_arguments_are_refused_by_name():
    """Stage counts that do not sum or have the wrong length, too many stages, a model with no
    blocks or no pipeline plan, unknown schedules, a schedule the cut cannot run, micro-batches
    that do not divide the batch."""
    from support.hf_pipeline import check_refusals

    run_on_ranks(check_refusals, 2)


def test_from_pretrained_and_save_pretrained_of_a_pipeline(tmp_path):
    """Qwen2 (tied): each rank reads its stages only, and the export after a pipelined step loads
    in transformers with the serial model's logits."""
    from support.hf_parallel import tiny_causal_lm
    from support.hf_pipeline import check_pretrained_round_trip

    tiny_causal_lm("qwen2", num_hidden_layers=3).save_pretrained(tmp_path / "in")
    run_on_ranks(check_pretrained_round_trip, 4, str(tmp_path / "in"), str(tmp_path / "out"))


@pytest.mark.parametrize("target, stages", [(dict(tp=4, tp_mode="2d"), None), (dict(pp=2, dp=2), [2, 1])],
                         ids=["to-pp1-2d", "to-pp2-dp2-uneven"])
def test_checkpoint_of_a_pipeline_reshards(tmp_path, target, stages):
    """A tied model's last stage saves its copy of the table as the table (written once) and
    reads it back from there, with its optimizer state, in any other cut or none."""
    from support.hf_pipeline import check_checkpoint_reshards

    run_on_ranks(check_checkpoint_reshards, 4, str(tmp_path / "ck"), target, stages)


def test_dropout_in_a_pipeline_draws_and_replays_its_masks():
    from support.hf_pipeline import check_pipeline_dropout

    run_on_ranks(check_pipeline_dropout, 4)


@pytest.mark.parametrize("mesh_kwargs, world, schedule, layers, options", [
    (dict(pp=2, tp=2), 4, "1f1b", 3, {}),
    (dict(pp=2), 2, "zbv", 4, dict(virtual_stages=2, placement="v")),
], ids=["pp2-1d-tp2-1f1b", "pp2-zbv"])
def test_a_module_of_ones_own_is_pipelined_by_its_pp_plan(mesh_kwargs, world, schedule, layers, options):
    """A model whose forward takes token ids only: a later stage's input takes its token
    embedding's place; the rank holding the first and last stage (V placement) runs both."""
    from support.user_model import check_user_model_pipeline

    run_on_ranks(functools.partial(check_user_model_pipeline, **options), world, mesh_kwargs, schedule, layers)


@pytest.mark.parametrize("seq", [16, 15], ids=["seq16", "seq15-padded"])
def test_megatron_sp_stages_send_their_sequence_chunk(seq):
    """pp=2 x 1d tp=2: each stage boundary carries this tp rank's chunk of the sequence,
    ceil(seq / tp) rows, not the whole activation; the loss equals serial."""
    from support.hf_pipeline import check_chunk_sends

    run_on_ranks(check_chunk_sends, 4, seq, 2)
