"""The ``dropout`` style: an ``nn.Dropout`` of a model of one's own draws its mask through the
layout's stream (``ParallelDropout``, parallel/dropouts.py). In 1d tp=2 the block outputs, replicated over tp, are identical
on both tp ranks with dropout on; at tp=1 the parallelized model draws what the plain model
draws from the same seed; with p=0 it equals serial exactly (test_parallelize_user.py)."""

import copy

import torch
import torch.distributed as dist

from shardzoo.testing import cached_mesh, run_on_ranks
from support.user_model import PLAN, TinyLM


def _block_outputs(model, ids) -> list[torch.Tensor]:
    """Each block's output [b, s, h] in one training forward."""
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, y: seen.append(y.detach())) for b in model.blocks]
    model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return seen


def _masks_agree_over_tp():
    import shardzoo
    from shardzoo.layers import ParallelDropout

    torch.manual_seed(0)
    mesh = cached_mesh(tp=2)
    # replicated between the blocks (Megatron sequence parallelism off): every block output is whole
    model = shardzoo.parallelize(TinyLM(dropout=0.5), mesh, PLAN, sequence_parallel=False)
    assert isinstance(model.drop, ParallelDropout) and not model.drop.parallel_region and model.blocks[1].drop.p == 0.5
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    dropped = _block_outputs(model.train(), ids)
    kept = _block_outputs(model.eval(), ids)
    assert not model.blocks[0].drop.training
    for y, y_eval in zip(dropped, kept):
        assert not torch.equal(y, y_eval), "dropout drew no mask in training"
        other = [torch.empty_like(y) for _ in range(2)]
        dist.all_gather(other, y, group=mesh.tp_group)
        assert torch.equal(other[0], other[1]), "tp ranks holding one replicated activation dropped differently"


def _tp1_equals_plain():
    import shardzoo

    torch.manual_seed(0)
    plain = TinyLM(dropout=0.3)
    model = shardzoo.parallelize(copy.deepcopy(plain), cached_mesh(dp=2), PLAN)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for train in (True, False):
        plain.train(train), model.train(train)
        torch.manual_seed(5)
        want = plain(ids)
        torch.manual_seed(5)
        got = shardzoo.gather_logits(model, model(input_ids=ids))
        torch.testing.assert_close(got, want)


def test_dropout_masks_agree_over_tp_ranks_of_a_replicated_activation():
    run_on_ranks(_masks_agree_over_tp, 2)


def test_dropout_at_tp1_draws_what_the_plain_model_draws():
    run_on_ranks(_tp1_equals_plain, 2)
