"""Gradient accumulation on a model loaded with ``shardzoo.from_pretrained``: two micro-batches
per dp replica under ``no_sync``, each forward given the step's count of real targets, equal one
large batch through the serial transformers model (loss and every weight after an SGD step),
with padding that makes the micro-batches' counts differ. The count comes either as
transformers' Trainer passes it (``num_items_in_batch=``: this replica's real targets of the
step) or from ``model.count_targets`` (``num_targets=``: the whole step's)."""

import pytest
import torch

from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS

pytest.importorskip("transformers", reason="reads transformers model directories")


def _accumulate(model_dir, how):
    import shardzoo
    from shardzoo.parallel import no_sync
    from support.finetune import batch, load_serial

    ids, mask, labels = batch(rows=4, pad=(0, 3, 7, 5))
    serial = load_serial(model_dir).train()
    serial(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with torch.no_grad():
        expected = {n: p - p.grad for n, p in serial.named_parameters()}
    expected_loss = serial(input_ids=ids, attention_mask=mask, labels=labels).loss.detach()

    mesh = cached_mesh(dp=2, tp=2)
    model = shardzoo.data_parallel(shardzoo.from_pretrained(model_dir, mesh).train(), mesh)
    optimizer = shardzoo.zero_optimizer(model, torch.optim.SGD, lr=1.0)
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)  # this replica's rows, then one row per micro-batch
    micro = [(ids[rows][i:i + 1], mask[rows][i:i + 1], labels[rows][i:i + 1]) for i in range(2)]
    if how == "num_items_in_batch":  # as transformers' Trainer counts them: shifted labels of this replica
        count = {"num_items_in_batch": sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in micro)}
    else:
        count = {"num_targets": model.count_targets([lab for _, _, lab in micro])}
    total = 0.0
    for k, (i, m, lab) in enumerate(micro):
        with no_sync(model) if k == 0 else torch.enable_grad():
            out = model(input_ids=i, attention_mask=m, labels=lab, **count)
            out.loss.backward()
        total = total + out.loss.detach()
    optimizer.step()
    assert_close(total, expected_loss, "the micro-batches' losses summed vs one large batch", terms=TINY_MODEL_TERMS)
    full = shardzoo.full_state_dict(model)
    for name, value in expected.items():
        assert_close(full[name], value, f"{name} after one accumulated step", terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("how", ["num_items_in_batch", "count_targets"])
def test_accumulated_micro_batches_equal_one_large_batch(tmp_path, how):
    from support.finetune import save_tiny_llama

    run_on_ranks(_accumulate, 4, save_tiny_llama(str(tmp_path / "hf")), how)
