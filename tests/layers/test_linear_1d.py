"""ParallelLinear1D against nn.Linear: init, output, input gradient and every parameter gradient.

Every rank builds the serial twin from the same seed, runs the parallel layer through
``shard_input`` / ``gather_output`` and compares full-size tensors; parameter gradients are
gathered to full size with ``gather_full`` and their ShardSpec."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close, cached_mesh, dtypes, run_on_ranks

DTYPES = dtypes("fp32", "fp64")


def _randn(seed, shape, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def full_grads(module, mesh):
    """Every parameter's gradient gathered to its global (serial) shape, by parameter name."""
    return {n: gather_full(p.grad, get_shard_spec(module, n), mesh) for n, p in module.named_parameters()}


def check_linear(case):
    dtype = DTYPES[case["dtype"]]
    mesh = cached_mesh(tp=case["tp"])
    fin, fout, b, s = case["in"], case["out"], case["batch"], case["seq"]
    torch.manual_seed(case["seed"])
    serial = nn.Linear(fin, fout, case["bias"], dtype=dtype)
    torch.manual_seed(case["seed"])
    kwargs = dict(style=case["style"], sequence_parallel=case["sp"])
    if case["style"] == "column":
        kwargs["gather_output"] = case["gather"]
    else:
        kwargs["input_is_parallel"] = case["parallel_input"]
    if case["from_serial"]:
        par = ParallelLinear1D.from_serial(serial, mesh, **kwargs)
    else:
        par = ParallelLinear1D(fin, fout, case["bias"], mesh=mesh, dtype=dtype, **kwargs)
    assert par.mesh is mesh
    for n, _ in par.named_parameters():
        assert get_shard_spec(par, n) is not None
    state = full_state_dict(par)
    assert state.keys() == serial.state_dict().keys()
    for k, v in serial.state_dict().items():
        assert torch.equal(state[k], v), f"init of {k} differs from nn.Linear's"

    x = _randn(case["seed"] + 1, (b, s, fin), dtype).requires_grad_(True)
    gy = _randn(case["seed"] + 2, (b, s, fout), dtype)
    y_ref = serial(x)
    y_ref.backward(gy)
    x_par = x.detach().clone().requires_grad_(True)
    y = par.gather_output(par(par.shard_input(x_par)))
    y.backward(gy)
    # output: a sum over fin; input grad: over fout; weight grad: over the b x s tokens
    tol = dict(terms=fin + fout + b * s, parts=case["tp"])
    assert_close(y, y_ref.detach(), "output", **tol)
    assert_close(x_par.grad, x.grad, "input grad", **tol)
    grads = full_grads(par, mesh)
    for n, p in serial.named_parameters():
        assert_close(grads[n], p.grad, f"{n} grad", **tol)
    return tuple(y.shape)


@st.composite
def linear_case(draw, tp):
    style = draw(st.sampled_from(["column", "row"]))
    sp = draw(st.booleans())
    fsplit = draw(st.integers(1, 3)) * tp
    fother = draw(st.integers(1, 6))
    return {
        "tp": tp, "style": style, "sp": sp, "bias": draw(st.booleans()),
        "gather": draw(st.booleans()), "parallel_input": draw(st.booleans()),
        "in": fother if style == "column" else fsplit, "out": fsplit if style == "column" else fother,
        "batch": draw(st.integers(1, 2)), "seq": draw(st.integers(1, 3)) * (tp if sp else 1),
        "dtype": draw(st.sampled_from(list(DTYPES))), "seed": draw(st.integers(0, 2**31)),
        "from_serial": draw(st.booleans()),
    }  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=12)
@given(data=st.data())
def test_linear_matches_serial(tp, data):
    case = data.draw(linear_case(tp))
    shapes = run_on_ranks(check_linear, tp, case)
    assert len(set(shapes)) == 1


@pytest.mark.parametrize("style", ["column", "row"])
@pytest.mark.parametrize("sp", [False, True])
def test_linear_fixed_example_8_ranks(style, sp):
    """The largest world with every option on (regression guard)."""
    case = {"tp": 8, "style": style, "sp": sp, "bias": True, "gather": True, "parallel_input": False,
            "in": 48, "out": 64, "batch": 2, "seq": 16, "dtype": "fp32", "seed": 7, "from_serial": False}
    run_on_ranks(check_linear, 8, case)


def divisibility_error(style, in_features, out_features):
    mesh = cached_mesh(tp=4)
    try:
        ParallelLinear1D(in_features, out_features, mesh=mesh, style=style)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("style, fin, fout, what, value", [("column", 8, 10, "out_features", 10),
                                                             ("row", 10, 8, "in_features", 10)])
def test_indivisible_features_raise_clear_error(style, fin, fout, what, value):
    for msg in run_on_ranks(divisibility_error, 4, style, fin, fout):
        assert msg is not None
        assert f"ParallelLinear1D(style='{style}') needs {what} divisible by tp=4; got {what}={value}" in msg
        assert "multiple of 4 (e.g. 12)" in msg


def sequence_parallel_comm(tp):
    """Column + row pair: one all-reduce each way without SP; with SP an all-gather and a
    reduce-scatter each way, plus the all-reduce of the row bias's gradient."""
    from shardzoo import comm

    mesh = cached_mesh(tp=tp)
    out = {}
    for sp in (False, True):
        col = ParallelLinear1D(8, 16, mesh=mesh, style="column", sequence_parallel=sp)
        row = ParallelLinear1D(16, 8, mesh=mesh, style="row", sequence_parallel=sp)
        x = torch.randn(2, 4 // (tp if sp else 1), 8, requires_grad=True)
        with comm.count() as c:
            row(col(x)).sum().backward()
        out[sp] = c.calls
    return out


def test_communication_pattern():
    calls = run_on_ranks(sequence_parallel_comm, 2, 2)[0]
    assert calls[False] == {"all_reduce": 2}
    assert calls[True] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}


def test_options_of_the_other_style_raise_clear_errors():
    with pytest.raises(ValueError, match="style='diagonal' is not one of"):
        ParallelLinear1D(4, 4, mesh=None, style="diagonal")
    with pytest.raises(ValueError, match="has no gather_output"):
        ParallelLinear1D(4, 4, mesh=None, style="row", gather_output=True)
    with pytest.raises(ValueError, match="input_is_parallel=False is for style='row'"):
        ParallelLinear1D(4, 4, mesh=None, style="column", input_is_parallel=False)


def autocast_column_row(tp: int, sp: bool):
    """Column -> row pair under CPU bf16 autocast against the serial pair under autocast:
    same output dtype, fp32 gradients, equal to the serial values at bf16 tolerance."""
    mesh = cached_mesh(tp=tp)
    torch.manual_seed(3)
    fc1, fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
    col = ParallelLinear1D.from_serial(fc1, mesh, style="column", sequence_parallel=sp)
    row = ParallelLinear1D.from_serial(fc2, mesh, style="row", sequence_parallel=sp)
    x = _randn(4, (2, 8, 16), torch.float32).requires_grad_(True)
    x_par = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = fc2(torch.relu(fc1(x)))
        y = row.gather_output(row(torch.relu(col(col.shard_input(x_par)))))
    assert y.dtype == y_ref.dtype == torch.bfloat16
    y_ref.float().square().sum().backward()
    y.float().square().sum().backward()
    tol = dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    torch.testing.assert_close(x_par.grad, x.grad, **tol)
    assert x_par.grad.dtype == torch.float32
    for par, ser in ((col, fc1), (row, fc2)):
        grads = full_grads(par, mesh)
        for n, p in ser.named_parameters():
            assert grads[n].dtype == torch.float32
            torch.testing.assert_close(grads[n], p.grad, atol=5e-2 * max(1.0, p.grad.abs().max().item()), rtol=5e-2)


@pytest.mark.parametrize("sp", [False, True])
def test_bf16_autocast_matches_serial(sp):
    run_on_ranks(autocast_column_row, 2, 2, sp)
