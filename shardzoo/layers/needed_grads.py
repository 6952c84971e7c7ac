"""Which input gradients a custom autograd Function's backward must make in the pass running now.

``ctx.needs_input_grad`` is fixed at forward time. A pipeline's split backward (the zero-bubble
schedules, torch's ``stage_backward_input`` / ``stage_backward_weight``) runs a layer's backward
node twice: once for the input gradients only, once for the weight gradients only. A layer that
made both each time would do its matmuls twice and its input gradient's tp collective twice. The
engine knows which of the node's edges it will follow (``torch._C._will_engine_execute_node``);
for a leaf that ``autograd.grad`` asks for (a weight in the weight pass) it does not say, and that
gradient is made.
"""

from __future__ import annotations

import torch


def mark_tensors(ctx, *args) -> None:
    """Record which forward arguments of ``ctx``'s Function are tensors (the engine keeps an edge
    for those only); call in ``forward`` with all its arguments, in order."""
    ctx.tensor_args = tuple(isinstance(a, torch.Tensor) for a in args)


def grads_needed(ctx) -> tuple[bool, ...]:
    """Per forward argument of ``ctx``'s Function (marked by :func:`mark_tensors`): whether the
    running backward uses its gradient (``ctx.needs_input_grad``, narrowed to the edges the
    autograd engine follows in this pass)."""
    edges = iter(ctx.next_functions)
    out = []
    for need, is_tensor in zip(ctx.needs_input_grad, ctx.tensor_args):
        node = next(edges)[0] if is_tensor else None
        if need and node is not None:
            try:
                need = torch._C._will_engine_execute_node(node)
            except RuntimeError:  # a leaf under autograd.grad: the engine does not say
                pass
        out.append(bool(need))
    return tuple(out)
