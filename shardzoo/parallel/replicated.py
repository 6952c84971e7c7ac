"""A module kept whole on every tp rank whose ranks see different parts of the data (style
``replicate_sum``, transformers' ``replicated_with_grad_allreduce``: Qwen3's per-head
q_norm), so each rank's gradient is a partial sum.

The module's own forward is not touched: a forward pre-hook hands it its parameters through
``copy_to`` (identity forward, all-reduce of the gradient over tp in backward) and a forward
hook puts the parameters back. Summing in the graph keeps accumulation, DDP and FSDP2 exact;
FSDP2 unshards its parameters before the owning block runs, so the hook wraps the unsharded
ones.
"""

from __future__ import annotations

from torch import nn

from shardzoo.comm import collectives as comm


def sum_grads_over(module: nn.Module, group) -> None:
    """Sum the gradients of ``module``'s own parameters over ``group`` in every backward."""
    saved: list[dict] = []

    def before(mod, args):
        originals = dict(mod._parameters)
        saved.append(originals)
        for name, p in originals.items():
            if p is not None:
                mod._parameters[name] = comm.copy_to(p, group)

    def after(mod, args, output):
        mod._parameters.update(saved.pop())

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)
