"""``model.generate`` on a model loaded with ``shardzoo.from_pretrained`` gives the serial
transformers model's tokens (greedy), in 1d tp=2, 2d tp=4 and 3d tp=8 (batch rows split too), with and
without the KV cache, from a left-padded batch and from one row; under sp it is refused, naming sp and the fix."""

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks

pytest.importorskip("transformers", reason="reads transformers model directories")

NEW_TOKENS = 5


def _prompt():
    from support.finetune import VOCAB

    ids = torch.randint(1, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left-padded, as generation batches are
    mask[3, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _generate(model, use_cache, rows=4):  # 4 rows: what 3d's batch split (tp_x * tp_y) takes
    ids, mask = (t[:rows] for t in _prompt())
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              use_cache=use_cache, pad_token_id=0)


def _parallel_generate(model_dir, mesh_kwargs):
    import shardzoo

    model = shardzoo.from_pretrained(model_dir, cached_mesh(**mesh_kwargs)).eval()
    return [_generate(model, use_cache) for use_cache in (False, True)] + [_generate(model, True, rows=1)]


@pytest.mark.parametrize("mesh_kwargs, world", [(dict(tp=2), 2), (dict(tp=4, tp_mode="2d"), 4),
                                                (dict(tp=8, tp_mode="3d"), 8)], ids=["1d", "2d", "3d"])
def test_generate_equals_serial(tmp_path, mesh_kwargs, world):
    from support.finetune import load_serial, save_tiny_llama

    model_dir = save_tiny_llama(str(tmp_path / "hf"))
    serial = load_serial(model_dir)
    expected = _generate(serial, True)
    assert torch.equal(_generate(serial, False), expected)
    assert len(set(expected[:, -NEW_TOKENS:].flatten().tolist())) > 2  # not a degenerate repetition
    single = _generate(serial, True, rows=1)  # one row: kept whole on every row rank of the grids
    for rank, outs in enumerate(run_on_ranks(_parallel_generate, world, model_dir, mesh_kwargs)):
        for what, got, want in zip(("no cache", "cache", "one row"), outs, (expected, expected, single)):
            assert torch.equal(got, want), f"rank {rank}, {what}: {got.tolist()} vs {want.tolist()}"


def _generate_under_sp(model_dir):
    import shardzoo

    model = shardzoo.from_pretrained(model_dir, cached_mesh(sp=2)).eval()
    with pytest.raises(ValueError, match=r"sequence parallelism \(sp=2\).*Generate with sp=1"):
        _generate(model, True)


def test_generate_under_sp_is_refused_by_name(tmp_path):
    from support.finetune import save_tiny_llama

    run_on_ranks(_generate_under_sp, 2, save_tiny_llama(str(tmp_path / "hf")))
