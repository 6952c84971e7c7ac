"""LayerNorm1D / RMSNorm1D against nn.LayerNorm / nn.RMSNorm (sequence parallel on and off), and a
pre-norm MLP block (LayerNorm -> column -> gelu -> row, + residual) that stays equal to its serial
twin through three AdamW steps."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.norm_1d import LayerNorm1D, RMSNorm1D
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close_conditioned, cached_mesh, dtypes, run_on_ranks
from shardzoo.testing.dtypes import rms_of

DTYPES = dtypes("fp32", "fp64")


def _randn(gen, shape, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def check_norm(case):
    dtype, tp = DTYPES[case["dtype"]], case["tp"]
    mesh = cached_mesh(tp=tp)
    hidden = case["hidden"]
    gen = torch.Generator().manual_seed(case["seed"])
    if case["kind"] == "layer":
        serial = nn.LayerNorm(hidden, elementwise_affine=case["affine"], bias=case["bias"], dtype=dtype)
        cls = LayerNorm1D
    else:
        serial = nn.RMSNorm(hidden, elementwise_affine=case["affine"], dtype=dtype)
        cls = RMSNorm1D
    with torch.no_grad():  # non-trivial parameters, so their gradients matter
        for p in serial.parameters():
            p.copy_(_randn(gen, p.shape, dtype))
    par = cls.from_serial(serial, mesh, sequence_parallel=case["sp"])
    assert par.mesh is mesh and all(get_shard_spec(par, n) is not None for n, _ in par.named_parameters())
    x = _randn(gen, (case["batch"], case["seq"], hidden), dtype).requires_grad_(True)
    gy = _randn(gen, x.shape, dtype)
    y_s = serial(x)
    y_s.backward(gy)
    # the serial math in float64: a norm over a row of tiny variance is ill-conditioned, and its
    # fp32 gradients are only as good as the serial run's own error says
    exact = copy.deepcopy(serial).double()
    x64 = x.detach().double().requires_grad_(True)
    y64 = exact(x64)
    y64.backward(gy.double())
    # in float64 the serial run is exact already: a float32 run gauges the conditioning instead
    gauge = copy.deepcopy(serial).float() if dtype == torch.float64 else None
    if gauge is not None:
        x32 = x.detach().float().requires_grad_(True)
        y32 = gauge(x32)
        y32.backward(gy.float())
    x_par = x.detach().clone().requires_grad_(True)
    y = par.gather_output(par(par.shard_input(x_par)))
    y.backward(gy)
    tol = dict(terms=hidden + case["batch"] * case["seq"], parts=tp)  # row statistics; weight grads over tokens
    assert_close_conditioned(y, y_s.detach(), y64.detach(), "output", gauge=None if gauge is None else y32.detach(),
                             **tol)
    assert_close_conditioned(x_par.grad, x.grad, x64.grad, "input grad", gauge=None if gauge is None else x32.grad,
                             **tol)
    gauges = list(gauge.parameters()) if gauge is not None else [None] * len(list(serial.parameters()))
    for (name, p), ref, ref64, ref32 in zip(par.named_parameters(), serial.parameters(), exact.parameters(), gauges):
        # replicated: every rank's local gradient must already be the full one
        assert_close_conditioned(p.grad, ref.grad, ref64.grad, f"{name} grad",
                                 gauge=None if ref32 is None else ref32.grad, **tol)
    return float(y.detach().sum())


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=8)
@given(data=st.data())
def test_norm_matches_serial(tp, data):
    sp = data.draw(st.booleans())
    case = {"tp": tp, "sp": sp, "kind": data.draw(st.sampled_from(["layer", "rms"])),
            "affine": data.draw(st.booleans()), "bias": data.draw(st.booleans()),
            "hidden": data.draw(st.integers(1, 9)), "batch": data.draw(st.integers(1, 2)),
            "seq": data.draw(st.integers(1, 3)) * (tp if sp else 1),
            "dtype": data.draw(st.sampled_from(list(DTYPES))), "seed": data.draw(st.integers(0, 2**31))}
    run_on_ranks(check_norm, tp, case)


class SerialMLP(nn.Module):
    def __init__(self, hidden, ffn, bias, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.fc1 = nn.Linear(hidden, ffn, bias, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, bias, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ParallelMLP(nn.Module):
    """The same block with 1D layers; activations outside fc1..fc2 are [b, s/p, h] under SP."""

    def __init__(self, serial: SerialMLP, mesh, sp: bool):
        super().__init__()
        self.mesh = mesh
        self.norm = LayerNorm1D.from_serial(serial.norm, mesh, sequence_parallel=sp)
        self.fc1 = ParallelLinear1D.from_serial(serial.fc1, mesh, style="column", sequence_parallel=sp)
        self.fc2 = ParallelLinear1D.from_serial(serial.fc2, mesh, style="row", sequence_parallel=sp)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def check_mlp_training(case):
    dtype, tp = DTYPES[case["dtype"]], case["tp"]
    mesh = cached_mesh(tp=tp)
    torch.manual_seed(case["seed"])
    serial = SerialMLP(case["hidden"], case["ffn"], case["bias"], dtype)
    par = ParallelMLP(serial, mesh, case["sp"])
    exact = copy.deepcopy(serial).double()  # the serial math in float64: how far fp32 itself is
    # in float64 the serial run is exact already: a float32 run gauges the conditioning instead
    gauge = copy.deepcopy(serial).float() if dtype == torch.float64 else None
    opt_serial = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    opt_exact = torch.optim.AdamW(exact.parameters(), lr=1e-2, weight_decay=0.1)
    opt_gauge = torch.optim.AdamW(gauge.parameters(), lr=1e-2, weight_decay=0.1) if gauge is not None else None
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    h, tokens = case["hidden"], case["batch"] * case["seq"]
    # the norm's weight and bias gradients are sums over the tokens of the gradient at its output:
    # kept from the float64 run, their size bounds the reordering where the sum cancels
    summands = {}
    def keep(module, args, out):
        out.retain_grad()
        summands["out"] = out

    exact.norm.register_forward_hook(keep)
    tol = dict(terms=2 * h + case["ffn"] + tokens, parts=tp)
    for step in range(3):
        x = _randn(gen, (case["batch"], case["seq"], case["hidden"]), dtype)
        target = _randn(gen, x.shape, dtype)
        loss_ref = F.mse_loss(serial(x), target)
        loss64 = F.mse_loss(exact(x.double()), target.double())
        loss32 = F.mse_loss(gauge(x.float()), target.float()) if gauge is not None else None
        y = par.norm.gather_output(par(par.norm.shard_input(x)))
        loss = F.mse_loss(y, target)
        assert_close_conditioned(loss, loss_ref.detach(), loss64.detach(), f"step {step} loss",
                                 gauge=None if loss32 is None else loss32.detach(), **tol)
        runs = [(opt_serial, loss_ref), (opt_par, loss), (opt_exact, loss64)] + ([(opt_gauge, loss32)] if gauge is not None else [])
        for opt, lo in runs:
            opt.zero_grad()
            lo.backward()
        grads = {n: gather_full(p.grad, get_shard_spec(par, n), mesh) for n, p in par.named_parameters()}
        g32 = {n: q.grad for n, q in gauge.named_parameters()} if gauge is not None else {}
        # a gradient summed over the tokens may cancel far below its summands (a LayerNorm over a
        # hidden size of 1 passes only its bias): their size bounds the reordering, as for every model
        floor = max(rms_of(q.grad for q in exact.parameters()), rms_of([summands["out"].grad]))
        for (n, p), p64 in zip(serial.named_parameters(), exact.parameters()):
            assert_close_conditioned(grads[n], p.grad, p64.grad, f"step {step} {n} grad", gauge=g32.get(n),
                                     floor=floor, **tol)
        for opt, _ in runs:
            opt.step()
    state, state64 = full_state_dict(par), exact.state_dict()
    state32 = gauge.state_dict() if gauge is not None else {}
    for n, v in serial.state_dict().items():
        assert_close_conditioned(state[n], v, state64[n], f"{n} after 3 AdamW steps", gauge=state32.get(n), **tol)
    return float(loss.detach())


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@settings(max_examples=4)
@given(data=st.data())
def test_mlp_block_three_adamw_steps_match_serial(tp, data):
    sp = data.draw(st.booleans())
    case = {"tp": tp, "sp": sp, "bias": data.draw(st.booleans()), "hidden": data.draw(st.integers(1, 6)),
            "ffn": data.draw(st.integers(1, 3)) * tp, "batch": data.draw(st.integers(1, 2)),
            "seq": data.draw(st.integers(1, 2)) * (tp if sp else 1),
            "dtype": data.draw(st.sampled_from(list(DTYPES))), "seed": data.draw(st.integers(0, 2**31))}
    run_on_ranks(check_mlp_training, tp, case)


@pytest.mark.parametrize("sp", [False, True])
def test_mlp_block_fixed_example_8_ranks(sp):
    case = {"tp": 8, "sp": sp, "bias": True, "hidden": 32, "ffn": 128, "batch": 2, "seq": 16, "dtype": "fp32",
            "seed": 21}
    run_on_ranks(check_mlp_training, 8, case)
