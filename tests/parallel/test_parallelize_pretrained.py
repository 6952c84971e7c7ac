"""``shardzoo.from_pretrained`` reads a transformers directory into a parallelized model (each
rank its own slices) and ``shardzoo.save_pretrained`` writes one back that transformers loads:
logits equal the serial model's, and the round trip gives back the same weights."""

import os

import pytest
import torch

from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS

pytest.importorskip("transformers", reason="reads and writes transformers model directories")


def _round_trip(kind, mesh_kwargs, src, dst, chunk_bytes=None):
    from shardzoo.models import transformers_io

    default = transformers_io._CHUNK_BYTES
    if chunk_bytes is not None:  # every tensor read in blocks of a few rows (this pooled worker, this test only)
        transformers_io._CHUNK_BYTES = chunk_bytes
    try:
        _check_round_trip(kind, mesh_kwargs, src, dst)
    finally:
        transformers_io._CHUNK_BYTES = default


def _check_round_trip(kind, mesh_kwargs, src, dst):
    import transformers

    import shardzoo
    from support.hf_parallel import padded_batch, tiny_causal_lm

    serial = tiny_causal_lm(kind).eval()
    ids, mask, _ = padded_batch()
    model = shardzoo.from_pretrained(src, cached_mesh(**mesh_kwargs)).eval()
    assert all(not p.is_meta for p in model.parameters())
    with torch.no_grad():
        logits = shardzoo.gather_logits(model, model(input_ids=ids, attention_mask=mask).logits)
        expected = serial(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close(logits[real], expected[real], "logits from the directory", terms=TINY_MODEL_TERMS)
    shardzoo.save_pretrained(model, dst)
    if torch.distributed.get_rank() == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
        for name, value in serial.state_dict().items():
            assert torch.equal(back.state_dict()[name], value), name
        with torch.no_grad():
            again = back(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(again, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind, mesh_kwargs, world, chunk_bytes", [
    ("llama", dict(tp=4), 4, None),                # kv heads replicated over tp
    ("gpt2", dict(tp=8, tp_mode="3d"), 8, None),   # Conv1D, packed c_attn read part by part
    ("llama", dict(tp=4), 4, 200),                 # large tensors: read in blocks of rows, one map each
    ("gpt2", dict(tp=2), 2, 200),                  # ... also the transposed Conv1D storage and packed c_attn
])
def test_from_pretrained_and_back(tmp_path, kind, mesh_kwargs, world, chunk_bytes):
    from support.hf_parallel import tiny_causal_lm

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tiny_causal_lm(kind).save_pretrained(src)
    run_on_ranks(_round_trip, world, kind, mesh_kwargs, src, dst, chunk_bytes)
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"], "a temporary directory was left behind"


def _missing_dir(path):
    import shardzoo
    from shardzoo.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no such directory"):
        shardzoo.from_pretrained(path, cached_mesh(tp=2))


def test_missing_directory_is_named(tmp_path):
    run_on_ranks(_missing_dir, 2, str(tmp_path / "nowhere"))


def _bf16_load(kind, mesh_kwargs, src):
    import transformers

    import shardzoo
    from shardzoo.testing import assert_close_conditioned
    from support.hf_parallel import padded_batch

    ids, mask, _ = padded_batch()
    serial = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    exact = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64).eval()
    model = shardzoo.from_pretrained(src, cached_mesh(**mesh_kwargs), dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = shardzoo.gather_logits(model, model(input_ids=ids, attention_mask=mask).logits)
        expected = serial(input_ids=ids, attention_mask=mask).logits
        truth = exact(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close_conditioned(logits[real], expected[real], truth[real], f"{kind} bf16 logits",
                             terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("kind, mesh_kwargs, world", [
    ("llama", dict(tp=2), 2),
    ("qwen2", dict(tp=4, tp_mode="2d"), 4),
])
def test_bf16_checkpoint_loads_and_equals_the_serial_bf16_model(tmp_path, kind, mesh_kwargs, world):
    """A checkpoint loaded in bf16, as users load them: its RMSNorm (computed in fp32 and cast
    back, with weights away from 1) is recognised as a plain RMSNorm, and the logits equal the
    serial bf16 model's."""
    from support.hf_parallel import tiny_causal_lm

    model = tiny_causal_lm(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(tmp_path))
    run_on_ranks(_bf16_load, world, kind, mesh_kwargs, str(tmp_path))
