"""The ranks of a tp (or sp) group given different batches are refused on the first forward,
naming tp / sp and the fix, before a step trains on a mix of them; ``check_inputs="every"``
checks every forward. Models loaded with ``shardzoo.from_pretrained``."""

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks

pytest.importorskip("transformers", reason="reads transformers model directories")


def _different_inputs(model_dir, axis):
    import shardzoo
    from shardzoo.layers.replicas import ReplicaMismatchError
    from shardzoo.testing.finetune import batch

    mesh = cached_mesh(**{"dp" if axis == "tp" else "sp": 2, "tp": 2})
    ids, mask, labels = batch(rows=2, seed=mesh.dp_rank)  # each dp replica its own rows: fine
    same = dict(input_ids=ids, attention_mask=mask, labels=labels)
    model = shardzoo.from_pretrained(model_dir, mesh)
    wrong = batch(rows=2, seed=10 + mesh.rank(axis))[0]  # rows that differ along the axis
    with pytest.raises(ReplicaMismatchError, match=r"the tp / sp ranks of one dp replica were given different inputs.*"
                                                   r"same full batch"):
        model(input_ids=wrong, attention_mask=mask, labels=labels)
    every = shardzoo.from_pretrained(model_dir, mesh, check_inputs="every")
    every(**same)  # equal: passes
    with pytest.raises(ReplicaMismatchError, match="check_inputs='every'"):
        every(input_ids=ids, attention_mask=mask, labels=batch(rows=2, seed=10 + mesh.rank(axis))[2])
    first = shardzoo.from_pretrained(model_dir, mesh)
    first(**same)
    with torch.no_grad():
        first(input_ids=wrong, attention_mask=mask)  # the default checks the first forward only


@pytest.mark.parametrize("axis", ["tp", "sp"])
def test_tp_or_sp_ranks_fed_different_inputs_are_refused(tmp_path, axis):
    from shardzoo.testing.finetune import save_tiny_llama

    run_on_ranks(_different_inputs, 4, save_tiny_llama(str(tmp_path / "hf")), axis)


def _unknown_check_inputs():
    import shardzoo
    from shardzoo.testing.finetune import tiny_llama

    with pytest.raises(ValueError, match="check_inputs='sometimes' is not one of"):
        shardzoo.parallelize(tiny_llama(), cached_mesh(tp=2), check_inputs="sometimes")


def test_unknown_check_inputs_is_named():
    run_on_ranks(_unknown_check_inputs, 2)  # on the pool: this process keeps no process group
