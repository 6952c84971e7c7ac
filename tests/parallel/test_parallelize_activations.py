"""A module of one's own whose forward takes float activations x [B, S, H] (a stack of blocks):
``parallelize`` splits x like the layout's activations, ``shardzoo.gather_output`` gives the
full [B, S, H] back, and forward, the input's gradient and every parameter after a step equal
the serial module."""

import copy

import pytest
import torch
from torch import nn

from shardzoo.testing import assert_close_conditioned, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from shardzoo.testing.meshes import with_world
from shardzoo.testing.pools import cached_mesh
from support.user_model import Block, assert_params_match

HIDDEN = 32
PLAN = {"blocks.*.ln_*": "norm", "blocks.*.attn.q": "column", "blocks.*.attn.k": "column",
        "blocks.*.attn.v": "column", "blocks.*.attn.o": "row", "blocks.*.fc1": "column", "blocks.*.fc2": "row",
        "ln": "norm"}


class Stack(nn.Module):
    """x [b, s, h] -> [b, s, h]: causal blocks, then a norm."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(HIDDEN, 4) for _ in range(layers))
        self.ln = nn.LayerNorm(HIDDEN)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


def _check(mesh_kwargs):
    import shardzoo

    torch.manual_seed(0)
    serial = Stack()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    g = torch.Generator().manual_seed(1)
    x, weights = torch.randn(4, 16, HIDDEN, generator=g), torch.randn(4, 16, HIDDEN, generator=g)

    def step(model, y_of):
        inp = x.detach().to(next(model.parameters()).dtype).requires_grad_()
        y = y_of(model, inp)
        loss = (y * weights.to(y.dtype)).sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-2 * p.grad
        return y.detach(), inp.grad

    (y_s, dx_s), (y_x, dx_x) = (step(m, lambda m, inp: m(inp)) for m in (serial, exact))
    shardzoo.parallelize(parallel, cached_mesh(**mesh_kwargs), PLAN)
    y_p, dx_p = step(parallel, lambda m, inp: shardzoo.gather_output(m, m(inp)))
    assert_close_conditioned(y_p, y_s, y_x, "output", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(dx_p, dx_s, dx_x, "input gradient", terms=TINY_MODEL_TERMS)
    assert_params_match(parallel, serial, exact)


@pytest.mark.parametrize("mesh_kwargs, world", [with_world(tp=2), with_world(tp=4, tp_mode="2d"),
                                                with_world(tp=2, sp=2)])
def test_float_activations_in_and_out_equal_serial(mesh_kwargs, world):
    run_on_ranks(_check, world, mesh_kwargs)
