"""``parallelize(..., checkpointing=True)``: every block of TinyLM recomputed in backward gives
the gradients of the model without checkpointing, bitwise: in 1d tp=2 + sp=2 ring with a
padding mask (the recompute re-enters the SDPA mode with that forward's mask) and in 2d tp=4,
whose dropout draws from the per-rank tp stream (replayed in the recompute), with and without
dropout."""

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks
from support.user_model import PLAN, TinyLM


def _grads(mesh, checkpointing: bool, dropout: float) -> tuple[dict, int]:
    """(this rank's gradient of every parameter, forwards of blocks.0) after one step."""
    import shardzoo
    from shardzoo.layers.rng_streams import manual_seed

    torch.manual_seed(0)
    model = shardzoo.parallelize(TinyLM(dropout=dropout), mesh, PLAN, checkpointing=checkpointing)
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda m, a, y: calls.append(1))
    wrapped = shardzoo.data_parallel(model, mesh) if mesh.sp_size > 1 else model
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, -5:] = 0
    manual_seed(mesh, 7)  # the default and tp streams start alike in both models
    logits = wrapped(input_ids=ids, attention_mask=mask)
    shardzoo.lm_loss(model, logits, ids.masked_fill(mask == 0, -100)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


def _recompute_equals_stored(mesh_kwargs: dict, dropout: float):
    mesh = cached_mesh(**mesh_kwargs)
    want, forwards = _grads(mesh, False, dropout)
    got, recomputed = _grads(mesh, True, dropout)
    assert (forwards, recomputed) == (1, 2), (forwards, recomputed)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), f"{name}: {(got[name] - grad).abs().max().item()}"


@pytest.mark.parametrize("mesh_kwargs", [dict(tp=2, sp=2), dict(tp=4, tp_mode="2d")], ids=["1d-tp2-sp2", "2d-tp4"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
def test_checkpointed_blocks_give_the_gradients_of_stored_activations(mesh_kwargs, dropout):
    run_on_ranks(_recompute_equals_stored, 4, mesh_kwargs, dropout)
