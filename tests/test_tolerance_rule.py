"""The one tolerance rule (shardzoo.testing.dtypes.reorder_bound) still catches real errors.

A column -> row pair, built by the layout from serial nn.Linear layers, is compared with its
serial twin and an fp64 twin exactly as the suite compares every layer, in 1d (tp=2) and 2d
(tp=4): it passes as built, and fails its comparison with one block of a shard dropped, with the
bias added twice, and with the backward's sums over tp left out.
"""

import contextlib
import copy

import pytest
import torch
from torch import nn

from shardzoo.comm import ops
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.testing import assert_close_conditioned, cached_mesh, margins, run_on_ranks
from shardzoo.testing.serial_twin import randn

MESHES = {"1d": (dict(tp=2), 2), "2d": (dict(tp=4, tp_mode="2d"), 4)}
HIDDEN, FFN, BATCH, SEQ = 16, 32, 4, 3


@contextlib.contextmanager
def unsummed_backward():
    """Every sum over a group inside returns this rank's own partial: the tp sums left out."""
    names = ("all_reduce", "all_reduce_start", "reduce", "reduce_scatter_start")
    saved = {n: getattr(ops, n) for n in names}
    own_chunk = (lambda x, group, dim: x.chunk(ops.group_size(group), dim)[ops.group_rank(group)])
    ops.all_reduce = lambda x, group, inplace=False: x if inplace else x.clone()
    ops.all_reduce_start = lambda x, group: None
    ops.reduce = lambda x, group, dst: x.clone()
    ops.reduce_scatter_start = lambda x, group, dim: ((lambda: own_chunk(x, group, dim)), None)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ops, n, f)


def _pair(mesh, seed):
    torch.manual_seed(seed)
    serial = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
    with torch.no_grad():  # biases of the size of the outputs, so one added twice is an error of that size
        serial[2].bias.copy_(randn(seed + 1, (HIDDEN,), torch.float32))
    layout = layout_of(mesh)
    par = nn.Sequential(layout.linear(serial=serial[0], style="column"), nn.GELU(),
                        layout.linear(serial=serial[2], style="row"))
    return serial, par, layout


def check_fault(mode, fault, seed):
    """Compare the pair with ``fault`` injected; the names of the comparisons that failed."""
    mesh = cached_mesh(**MESHES[mode][0])
    serial, par, layout = _pair(mesh, seed)
    exact = copy.deepcopy(serial).double()
    x = randn(seed + 2, (BATCH, SEQ, HIDDEN), torch.float32)
    g = randn(seed + 3, (BATCH, SEQ, HIDDEN), torch.float32)
    xs, xe, xp = x.clone().requires_grad_(True), x.double().requires_grad_(True), x.clone().requires_grad_(True)
    ys, ye = serial(xs), exact(xe)
    (ys * g).sum().backward()
    (ye * g.double()).sum().backward()
    if fault == "dropped block" and mesh.rank() == 0:
        with torch.no_grad():
            par[0].weight[: par[0].weight.shape[0] // 2].zero_()  # half of rank 0's shard never arrives
    y = layout.gather_output(par(layout.shard_input(xp)))
    if fault == "bias twice":
        y = y + serial[2].bias.detach()
    with unsummed_backward() if fault == "unsummed gradient" else contextlib.nullcontext():
        (y * g).sum().backward()
    failed = []
    tol = dict(terms=HIDDEN + FFN + BATCH * SEQ, parts=mesh.tp_size)
    pairs = [("output", y.detach(), ys.detach(), ye.detach()), ("input grad", xp.grad, xs.grad, xe.grad)]
    for i in (0, 2):
        for name in ("weight", "bias"):
            full = gather_full(getattr(par[i], name).grad, get_shard_spec(par[i], name), mesh)
            pairs.append((f"{i}.{name} grad", full, getattr(serial[i], name).grad, getattr(exact[i], name).grad))
    for what, a, e, x64 in pairs:
        try:  # a comparison expected to fail stays out of the margin report
            with margins.paused() if fault != "none" else contextlib.nullcontext():
                assert_close_conditioned(a, e, x64, f"{mode} {fault}: {what}", **tol)
        except AssertionError:
            failed.append(what)
    return failed


@pytest.mark.parametrize("mode", list(MESHES))
@pytest.mark.parametrize("fault", ["none", "dropped block", "bias twice", "unsummed gradient"])
def test_the_rule_catches_a_wrong_shard(mode, fault):
    failed = run_on_ranks(check_fault, MESHES[mode][1], mode, fault, 7)[0]
    if fault == "none":
        assert failed == [], f"{mode}: the correct pair failed {failed}"
    else:
        assert failed, f"{mode}: the pair with a {fault} passed every comparison"
    # where each fault must show first: the forward for a wrong shard or bias, the input gradient
    # (summed over tp in every layout) for a missing sum
    first = {"dropped block": "output", "bias twice": "output", "unsummed gradient": "input grad"}
    if fault in first:
        assert first[fault] in failed, f"{mode}: a {fault} failed only {failed}"
