"""A zero 0 / 1 model's forward hooks run once per call, whether it is called itself or a
pipeline stage calls its DDP engine (torch's stages do): a parallelized model's SDPA mode and a
family stage's mask hooks live there."""

import torch
from torch import nn

from shardzoo.testing import run_on_ranks


def check_hooks_run_once() -> list[int]:
    import shardzoo
    from shardzoo.parallel import ddp_of
    from shardzoo.testing.pools import cached_mesh

    model = nn.Linear(4, 4)
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model.register_forward_hook(lambda m, a, y: calls.append("post"))
    shardzoo.data_parallel(model, cached_mesh(dp=2))
    x = torch.randn(2, 4)
    y_model = model(x)
    y_engine = ddp_of(model)(x)
    assert torch.equal(y_model, y_engine)
    assert calls == ["pre", "post", "pre", "post"], calls
    return calls


def test_forward_hooks_run_when_the_ddp_engine_is_called():
    run_on_ranks(check_hooks_run_once, 2)
