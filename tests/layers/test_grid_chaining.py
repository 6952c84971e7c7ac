"""Chaining the 2D / 2.5D / 3D layers: the placement contract (factory chaining, what is
checked at construction and by shape), and a transformer MLP block
(shardzoo.testing.grid.MLPBlock) trained for three AdamW steps against serial, on every grid
mesh (with dp=2 or sp=2 around the 2D grid each replica / sp rank feeds its own data)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers import placements
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.layers.full_state import full_state_dict
from shardzoo.testing import assert_close, assert_close_conditioned, run_on_ranks
from shardzoo.testing.grid import BATCH_PARTS, DTYPES, MLPBlock, mesh_of, parallel_mlp, world_of
from shardzoo.testing.serial_twin import check_grads_match, data_seed, norm_floors, perturbed, randn


# -- placements are fixed at construction: what is checked, and where -------------------------
def error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{fn} accepted a bad input")


def check_placement_contract(name, seed):
    """The factory chains a column / row pair on the right placements and equals serial; a
    placement of another mode is refused at construction; a block of the wrong shape at run time."""
    mesh = mesh_of(name)
    layout = layout_of(mesh)
    torch.manual_seed(seed)
    s1, s2 = nn.Linear(8, 16, dtype=torch.float64), nn.Linear(16, 8, dtype=torch.float64)
    x_full = randn(seed, (2 * BATCH_PARTS[name], 3, 8), torch.float64)
    fc1, fc2 = layout.linear(serial=s1, style="column"), layout.linear(serial=s2, style="row")
    assert fc1.placement == layout.activation and fc2.placement == layout.after(fc1)
    assert layout.after(fc2) == layout.activation
    y = fc2(fc1(layout.shard_input(x_full)))
    assert_close(layout.gather_output(y).detach(), s2(s1(x_full)).detach(), "factory-chained pair", terms=8 + 16 + 16,
                 parts=mesh.tp_size)
    other = placements.ActivationPlacement("2.5d" if layout.mode != "2.5d" else "2d", ("tp_row",), "tp_col")
    m = error_of(type(fc1).from_serial, s1, mesh, placement=other)
    assert f"got a placement for tp_mode={other.mode!r}" in m and "Pass the output_placement" in m, m
    m = error_of(fc1, x_full)  # the full activation where a local block is expected
    assert "expects the local input block" in m and "shard_input(x_full)" in m, m
    return True


@pytest.mark.parametrize("name", ["2d", "3d"])
def test_placement_contract(name):
    """A block in another placement of the same shape cannot be detected (docs/design.md,
    "Placements are fixed at construction"); what can be checked is, at construction and by shape."""
    assert all(run_on_ranks(check_placement_contract, world_of(name), name, 1))


# -- a transformer MLP block trained for three AdamW steps ----------------------------------
def check_mlp_training(case):
    """The MLP block and three AdamW steps stay equal to serial; case: name, hidden, ffn,
    batch, seq, dtype, seed."""
    mesh = mesh_of(case["name"])
    dtype, seed, h = DTYPES[case["dtype"]], case["seed"], case["hidden"]
    torch.manual_seed(seed)
    serial = MLPBlock(perturbed(nn.LayerNorm(h, dtype=dtype), seed), nn.Linear(h, case["ffn"], dtype=dtype),
                      nn.Linear(case["ffn"], h, dtype=dtype))
    par = parallel_mlp(serial, mesh)
    exact = copy.deepcopy(serial).double()  # the serial math in float64: the serial run's own rounding error
    # in float64 the serial run is exact already: a float32 run gauges the conditioning instead
    gauge = copy.deepcopy(serial).float() if dtype == torch.float64 else None
    models = [m for m in (serial, par, exact, gauge) if m is not None]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    for step in range(3):
        dseed = data_seed(seed + 7 * step, mesh)
        x = randn(dseed, (case["batch"], case["seq"], h), dtype)
        g = randn(dseed + 1, x.shape, dtype)
        xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        xe = x.detach().double().clone().requires_grad_(True)
        y_s = serial(xs)
        (y_s * g).sum().backward()
        ln_out = []

        def keep_grad(module, args, out):  # the norm output's gradient, kept for norm_floor
            out.retain_grad()
            ln_out.append(out)

        hook = exact.ln.register_forward_hook(keep_grad)
        y_e = exact(xe)
        hook.remove()
        (y_e * g.double()).sum().backward()
        # the norm's input gradient cancels over a short row (hidden 2): its rounding is of the
        # size of its terms, not of the result
        norm_floor = norm_floors(exact.ln, xe, ln_out[0].grad)[1]
        y_p = placements.gather_activation(par(placements.shard_activation(xp, mesh)), mesh)
        (y_p * g).sum().backward()
        y_g = xg = None
        if gauge is not None:
            xg = x.detach().float().requires_grad_(True)
            y_g = gauge(xg)
            (y_g * g.float()).sum().backward()
            y_g = y_g.detach()
        # the reductions: the norm's row, fc1 over h, fc2 over ffn, weight gradients over the tokens
        terms = 2 * h + case["ffn"] + case["batch"] * case["seq"]
        tol = dict(terms=terms, parts=mesh.tp_size)
        assert_close_conditioned(y_p.detach(), y_s.detach(), y_e.detach(), f"step {step} output", gauge=y_g, **tol)
        assert_close_conditioned(xp.grad, xs.grad, xe.grad, f"step {step} input grad",
                                 gauge=None if xg is None else xg.grad, floor=norm_floor, **tol)
        check_grads_match(par, serial, mesh, f"step {step}", exact=exact, terms=terms, gauge=gauge)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # Adam normalises each element by its own gradient history, so an element whose gradient is
    # near zero is ill-conditioned: the fp64 twin's state says how far fp32 itself strays there
    state, ref, ref64 = full_state_dict(par), serial.state_dict(), exact.state_dict()
    ref32 = gauge.state_dict() if gauge is not None else {}
    for k, v in ref.items():
        assert_close_conditioned(state[k], v, ref64[k], f"after 3 AdamW steps {k}", gauge=ref32.get(k), **tol)
    return True


def mlp_case(draw, name, q=2):
    hidden_mult = q * q if name == "3d" else q  # 3D: both linears need out_features divisible by q*q
    return dict(name=name, hidden=hidden_mult * draw(st.integers(1, 3)), ffn=q * q * draw(st.integers(1, 3)),
                batch=BATCH_PARTS[name] * draw(st.integers(1, 2)), seq=draw(st.integers(1, 3)),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)))


@pytest.mark.parametrize("name", ["2d", "2d_dp2", "2d_sp2", "2.5d", "2.5d_d1", "3d"])
@given(data=st.data())
@settings(max_examples=4)
def test_mlp_block_three_adamw_steps(name, data):
    run_on_ranks(check_mlp_training, world_of(name), mlp_case(data.draw, name))


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_mlp_block_fixed_largest(name):
    run_on_ranks(check_mlp_training, world_of(name), dict(name=name, hidden=32, ffn=128, batch=8, seq=8, dtype="fp32",
                                                          seed=3))
