"""A layer's backward makes only the gradients the running pass uses (layers/needed_grads.py): a
pipeline's split backward asks a node for its input gradient and its weight gradient in two
passes, and each pass computes (and communicates) its half only. The gradients themselves are
checked against serial by the pipeline tests (tests/parallel/test_pipeline_hf.py)."""

import functools

import torch

from shardzoo.layers.needed_grads import grads_needed, mark_tensors
from shardzoo.testing import cached_mesh, run_on_ranks


class _Recording(torch.autograd.Function):
    """y = x W^T; records which gradients each backward call was asked for."""

    calls: list = []

    @staticmethod
    def forward(ctx, x, weight, tag):
        mark_tensors(ctx, x, weight, tag)
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, _ = grads_needed(ctx)
        _Recording.calls.append((need_x, need_w))
        return (dy @ weight if need_x else None), (dy.t() @ x if need_w else None), None


def _graph():
    stage_input = torch.randn(3, 4, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(5, 4))
    x = stage_input * 2  # the layer's input comes out of the stage's earlier work
    loss = _Recording.apply(x, weight, "tag").square().sum()
    return stage_input, weight, loss


def test_each_pass_makes_only_the_gradients_it_uses():
    stage_input, weight, loss = _graph()
    _Recording.calls.clear()
    (d_in,) = torch.autograd.grad(loss, [stage_input], retain_graph=True)  # the input pass
    (d_w,) = torch.autograd.grad(loss, [weight], retain_graph=True)  # the weight pass
    loss.backward()  # an ordinary backward: both
    assert _Recording.calls == [(True, False), (False, True), (True, True)]
    torch.testing.assert_close(d_in, stage_input.grad, rtol=0, atol=0)
    torch.testing.assert_close(d_w, weight.grad, rtol=0, atol=0)


def test_a_layer_reading_the_stage_input_directly():
    """The layer's input is the stage's input itself, a leaf: the input pass asks for it (the
    engine does not report a leaf ``autograd.grad`` asks for, so its gradient is made), the weight
    pass does not."""
    stage_input = torch.randn(3, 4, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(5, 4))
    loss = _Recording.apply(stage_input, weight, "tag").sum()
    _Recording.calls.clear()
    torch.autograd.grad(loss, [stage_input], retain_graph=True)
    torch.autograd.grad(loss, [weight])
    assert _Recording.calls == [(True, False), (False, True)]


def _tp_bytes_per_step(schedule: str, options: dict) -> int:
    """Bytes this rank sends over tp in one pipelined step of a 4-block GPT-2 at pp=2 x 1d tp=2,
    Megatron sequence parallelism off (every column layer all-reduces its input gradient)."""
    import shardzoo
    from shardzoo import comm
    from support.hf_parallel import padded_batch, tiny_causal_lm

    mesh = cached_mesh(pp=2, tp=2)
    model = shardzoo.parallelize(tiny_causal_lm("gpt2", n_layer=4), mesh, **options)
    pipe = shardzoo.pipeline(model, mesh, n_microbatches=2, schedule=schedule)
    ids, mask, labels = padded_batch()
    with comm.count() as counter:
        pipe.step(input_ids=ids, attention_mask=mask, labels=labels)
    return int(sum(r.bytes_sent for r in counter.records if r.group_size == 2 and r.kind != "send"
                   and r.kind != "recv" and r.kind != "broadcast"))


def test_split_backward_sends_what_an_ordinary_backward_sends_over_tp():
    """Under the zero-bubble schedule each column layer's input-gradient collective runs in the
    input pass only, not again in the weight pass: a step sends over tp what the interleaved 1F1B
    schedule sends for the same cut."""
    cut = dict(virtual_stages=2, sequence_parallel=False)
    ordinary = run_on_ranks(functools.partial(_tp_bytes_per_step, options=cut), 4, "interleaved_1f1b")
    split = run_on_ranks(functools.partial(_tp_bytes_per_step, options=cut), 4, "zero_bubble")
    assert split == ordinary, (split, ordinary)
