"""Compare a parallel module with its serial twin on every rank: state, outputs and gradients.

Each rank builds the serial module from the same seed, runs the parallel one between its
``shard_input`` and ``gather_output`` and compares full-size results; parameter gradients are
gathered to full size with their ShardSpec. With dp > 1 (or sp > 1) each data-parallel replica
draws its own data (:func:`data_seed`) and is compared with the serial module on that data.

    def check(seed):                      # module-level: runs on every rank of a pool
        mesh = cached_mesh(tp=4, tp_mode="2d")
        torch.manual_seed(seed)
        serial = nn.Linear(8, 4)
        par = ParallelLinear2D.from_serial(serial, mesh)
        check_state_matches(par, serial, "linear")
        x = randn(data_seed(seed, mesh), (4, 3, 8), torch.float32)
        return compare_module(par, serial, mesh, x, "linear", seed + 1)
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing.asserts import assert_close, assert_close_conditioned
from shardzoo.testing.dtypes import rms_of


def randn(seed: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values of ``shape`` drawn in float64 from ``seed``, then cast to ``dtype``
    (the same values on every rank and in every dtype)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def data_seed(seed: int, mesh) -> int:
    """A seed per data-parallel replica and sequence-parallel rank: each draws its own data."""
    return seed + 1000 * (mesh.rank("dp", "sp") + 1)


def perturbed(module: nn.Module, seed: int) -> nn.Module:
    """``module`` with every parameter replaced by random values (so gradients of affine
    parameters and padding rows are exercised away from the default init)."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(randn(seed + i, p.shape, p.dtype))
    return module


def check_state_matches(par: nn.Module, serial: nn.Module, what: str) -> None:
    """``full_state_dict(par)`` equals ``serial.state_dict()`` exactly (keys and values), and
    every parameter of ``par`` has a ShardSpec."""
    state = full_state_dict(par)
    ref = serial.state_dict()
    assert state.keys() == ref.keys(), f"{what}: state keys {sorted(state)} != {sorted(ref)}"
    for k, v in ref.items():
        assert torch.equal(state[k], v), f"{what}: initial {k} differs from serial"
    for n, p in par.named_parameters():
        assert get_shard_spec(par, n) is not None, f"{what}: parameter {n} has no ShardSpec"


def check_grads_match(par: nn.Module, serial: nn.Module, mesh, what: str, exact: nn.Module | None = None,
                      terms: int = 1, gauge: nn.Module | None = None, floor: float = 0.0,
                      condition: float = 1.0) -> None:
    """Every parameter gradient of ``par``, gathered to full size, equals the serial one (same
    parameter names) within ``reorder_bound``: measured against ``exact`` (the serial module in
    float64, after the same backward; ``gauge``: in float32, where the serial one is float64)
    where given, else from ``terms`` alone. ``floor``: the size of the summands behind the
    gradients where it exceeds their own root-mean-square (they cancel); ``condition``: how much
    the math amplifies a rounding (see ``reorder_bound``)."""
    ref = dict(serial.named_parameters())
    ref64 = dict(exact.named_parameters()) if exact is not None else {}
    ref32 = dict(gauge.named_parameters()) if gauge is not None else {}
    parts, summands = mesh.tp_size, max(floor, rms_of(q.grad for q in serial.parameters()))
    for n, p in par.named_parameters():
        assert p.grad is not None, f"{what}: {n} got no gradient"
        full = gather_full(p.grad, get_shard_spec(par, n), mesh)
        if exact is not None:
            assert_close_conditioned(full, ref[n].grad, ref64[n].grad, f"{what} grad {n}", terms=terms, parts=parts,
                                     gauge=ref32[n].grad if gauge is not None else None, floor=floor,
                                     condition=condition)
        else:
            assert_close(full, ref[n].grad, f"{what} grad {n}", terms=terms, parts=parts, floor=summands,
                         condition=condition)


def compare_module(par: nn.Module, serial: nn.Module, mesh, x_full: torch.Tensor, what: str,
                   loss_weight_seed: int) -> tuple[int, ...]:
    """Forward + backward of ``par`` (through shard_input / gather_output) against ``serial``
    on the full input ``x_full``; a fixed random output weighting makes every gradient
    non-trivial. Outputs and input gradients may differ from serial by the dtype's tolerance
    plus a few times the serial result's own error against float64. Returns the full output
    shape."""
    float_input = x_full.is_floating_point()
    xs = x_full.clone().requires_grad_(float_input)
    ys = serial(xs)
    g = randn(loss_weight_seed, ys.shape, ys.dtype)
    (ys * g).sum().backward()
    # the same serial math in float64: how far the serial result itself is from exact; where the
    # serial run is float64 already, a float32 run gauges the conditioning instead
    serial64, y64, dx64 = _twin_run(serial, x_full, g, torch.float64)
    gauge, y32, dx32 = _twin_run(serial, x_full, g, torch.float32) if ys.dtype == torch.float64 else (None,) * 3
    xp = x_full.clone().requires_grad_(float_input)
    y = par.gather_output(par(par.shard_input(xp)))
    # the reductions: over the input width (forward), the output width (input grad), the tokens (weight grads)
    terms = (x_full.shape[-1] if float_input else 1) + ys.shape[-1] + ys[..., 0].numel()
    tol = dict(terms=terms, parts=mesh.tp_size)
    # a norm's output and input gradient may cancel their terms: their size is the floor
    out_floor, grad_floor = norm_floors(serial, x_full, g) if isinstance(serial, nn.LayerNorm) else (0.0, 0.0)
    assert_close_conditioned(y, ys.detach(), y64, f"{what} output", gauge=y32, floor=out_floor, **tol)
    (y * g).sum().backward()
    if float_input:
        assert_close_conditioned(xp.grad, xs.grad, dx64, f"{what} input grad", gauge=dx32, floor=grad_floor, **tol)
    check_grads_match(par, serial, mesh, what, exact=serial64, terms=terms, gauge=gauge)
    return tuple(y.shape)


def norm_floors(norm: nn.LayerNorm, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The size of the terms behind each element of a LayerNorm's output and input gradient
    (x, dy [..., H]; the ``floor`` of ``reorder_bound``, [..., H] each): |w| (|x| + |mean|) rstd
    + |b| for the output (torch's kernel computes x (rstd w) + (b - mean rstd w), whose terms are
    of the row's size, not its spread's), and rstd (|dxhat| + mean |dxhat| + |xhat| mean |dxhat
    xhat|) for the input gradient rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = w dy.
    Either may cancel to a small fraction of its terms (over a row of two, xhat is +-1 whatever the
    values and the input gradient is eps / var of its terms), so its rounding is of their size."""
    x, dy = x.detach().double(), dy.detach().double()
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    xhat = ((x - mean) * rstd).abs()
    weight = norm.weight.detach().double().abs() if norm.weight is not None else 1.0
    bias = norm.bias.detach().double().abs() if norm.bias is not None else 0.0
    dxhat = weight * dy.abs()
    grad = rstd * (dxhat + dxhat.mean(-1, keepdim=True) + xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return weight * (x.abs() + mean.abs()) * rstd + bias, grad


def _twin_run(serial: nn.Module, x_full: torch.Tensor, g: torch.Tensor, dtype: torch.dtype):
    """A copy of ``serial`` in ``dtype``, run forward and backward on ``x_full`` with output
    weighting ``g``: (the copy, holding its gradients; its output; its input gradient or None)."""
    twin = copy.deepcopy(serial).to(dtype)
    x = x_full.detach().to(dtype).requires_grad_(True) if x_full.is_floating_point() else x_full
    y = twin(x)
    (y * g.to(dtype)).sum().backward()
    return twin, y.detach(), x.grad if x_full.is_floating_point() else None
