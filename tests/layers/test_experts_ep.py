"""Expert parallelism at the layer: dispatch then combine is the identity (values, gradients and
bytes), and ExpertsEP equals transformers' own experts module on every rank's tokens, forward
and backward, at ep 2 and 4, also where a rank's experts receive no row at all."""

import copy
from fractions import Fraction

import pytest
import torch

from shardzoo import comm
from shardzoo.layers.expert_dispatch import run_experts
from shardzoo.layers.experts import ExpertsEP, grouped_ok
from shardzoo.testing import assert_close_conditioned, cached_mesh, model_terms, run_on_ranks

WORLD, HIDDEN, FFN, TOP_K = 4, 32, 16, 2


def routing(rank: int, n_experts: int, skip: int | None = None):
    """Rank ``rank``'s tokens (6 + rank, integer-valued) and routing over ``n_experts``: distinct
    experts per token, never expert ``skip`` (so one expert receives no token)."""
    g = torch.Generator().manual_seed(100 + rank)
    tokens = 6 + rank
    x = torch.randint(-4, 5, (tokens, HIDDEN), generator=g).float()
    scores = torch.rand(tokens, n_experts, generator=g)
    if skip is not None:
        scores[:, skip] = -1.0
    index = scores.topk(TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
    return x, index, weights


def identity_round_trip(layout, n_experts):
    mesh = cached_mesh(**layout)
    ep = mesh.ep_size
    x, index, _ = routing(mesh.rank(), n_experts, skip=n_experts - 1)
    x.requires_grad_(True)
    weights = torch.zeros(x.shape[0], TOP_K)
    weights[:, 0] = 1.0  # one term per token: the sum is exact
    weights.requires_grad_(True)
    g = torch.randint(-3, 4, x.shape, generator=torch.Generator().manual_seed(mesh.rank())).float()
    with comm.count() as counted:
        out = run_experts(x, index, weights, n_experts, mesh.group("ep"), lambda rows, sizes: rows)
        (out * g).sum().backward()
    assert torch.equal(out, x.detach())
    assert torch.equal(x.grad, g)
    assert torch.equal(weights.grad, (g * x.detach()).sum(-1, keepdim=True).expand(-1, TOP_K))
    # bytes: the counts (int64 [E], an even all-to-all), then H floats for each pair this rank
    # sends to another rank's expert (dispatch forward, combine backward) and for each pair it
    # receives from another rank (combine forward, dispatch backward)
    n_local = n_experts // ep
    away = int((index // n_local != mesh.ep_rank).sum())
    first = mesh.rank("dp", "sp") - mesh.ep_rank  # the ep group's first rank in dp x sp
    arrived = sum(int((routing(first + r, n_experts, skip=n_experts - 1)[1] // n_local == mesh.ep_rank).sum())
                  for r in range(ep) if r != mesh.ep_rank)
    expected = {"all_to_all": Fraction(ep - 1, ep) * 8 * n_experts,
                "all_to_all_v": Fraction(2 * HIDDEN * 4 * (away + arrived))}
    assert counted.bytes == expected, (counted.bytes, expected)
    return away


@pytest.mark.parametrize("layout", [dict(dp=4, ep=4), dict(dp=2, sp=2, ep=2)], ids=["ep4", "ep2"])
def test_dispatch_then_combine_is_the_identity(layout):
    away = run_on_ranks(identity_round_trip, WORLD, layout, 8)
    assert sum(away) > 0  # tokens did cross ranks


def capacity_round_trip(layout, n_experts, capacity):
    """With ``capacity`` each rank sends each expert its first ``capacity`` pairs (token order);
    the others add zero to the output and get no gradient."""
    mesh = cached_mesh(**layout)
    x, index, _ = routing(mesh.rank(), n_experts)
    x.requires_grad_(True)
    weights = torch.tensor([0.75, 0.25]).expand(x.shape[0], TOP_K).clone().requires_grad_(True)  # sums exact
    g = torch.randint(-3, 4, x.shape, generator=torch.Generator().manual_seed(mesh.rank())).float()
    out = run_experts(x, index, weights, n_experts, mesh.group("ep"), lambda rows, sizes: rows, capacity=capacity)
    (out * g).sum().backward()
    place = torch.zeros_like(index)  # each pair's place among this rank's pairs to its expert
    for e in range(n_experts):
        hit = (index.reshape(-1) == e).nonzero().squeeze(1)
        place.view(-1)[hit] = torch.arange(hit.numel())
    kept = (place < capacity).float()
    assert torch.equal(out, (weights.detach() * kept).sum(-1, keepdim=True) * x.detach())
    assert torch.equal(x.grad, (weights.detach() * kept).sum(-1, keepdim=True) * g)
    assert torch.equal(weights.grad, (g * x.detach()).sum(-1, keepdim=True) * kept)
    return int((kept == 0).sum())


def test_capacity_drops_the_pairs_over_it():
    dropped = run_on_ranks(capacity_round_trip, WORLD, dict(dp=4, ep=4), 4, 2)
    assert sum(dropped) > 0  # some pairs were over capacity


def _tiny_experts(n_experts: int, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    module = MixtralExperts(MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=n_experts))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module.to(dtype)


def experts_against_serial(layout, n_experts, dtype):
    mesh = cached_mesh(**layout)
    serial = _tiny_experts(n_experts, dtype)
    layer = ExpertsEP.from_serial(copy.deepcopy(serial), mesh)
    assert layer.num_experts == n_experts // mesh.ep_size
    runs = {}
    for name, module in (("serial", serial), ("exact", copy.deepcopy(serial).double())):
        total, outs = 0, []
        for r in range(mesh.size("dp", "sp")):  # the serial module runs every rank's tokens
            x, index, weights = routing(r, n_experts)
            out = module(x.to(module.down_proj.dtype), index, weights.to(module.down_proj.dtype))
            total = total + (out * torch.cos(x)).sum()
            outs.append(out.detach())
        total.backward()
        runs[name] = (outs, {n: p.grad for n, p in module.named_parameters()})
    x, index, weights = routing(mesh.rank("dp", "sp"), n_experts)
    out = layer(x.to(dtype), index, weights.to(dtype))
    (out * torch.cos(x)).sum().backward()
    rank = mesh.rank("dp", "sp")
    tokens = sum(6 + r for r in range(mesh.size("dp", "sp"))) * TOP_K
    terms = model_terms(hidden=HIDDEN, layers=1, seq=1, tokens=tokens, ffn=FFN)
    assert_close_conditioned(out.detach(), runs["serial"][0][rank], runs["exact"][0][rank], "experts output",
                             terms=terms)
    n_local = layer.num_experts
    mine = slice(mesh.ep_rank * n_local, (mesh.ep_rank + 1) * n_local)
    for name in ("gate_up_proj", "down_proj"):
        # every rank's loss here is its own sum (no global-mean factor R = dp*sp): times R
        got = getattr(layer, name).grad * mesh.size("dp", "sp")
        assert_close_conditioned(got, runs["serial"][1][name][mine], runs["exact"][1][name][mine],
                                 f"{name} gradient", terms=terms)
    return grouped_ok(x.to(dtype), layer.gate_up_proj, layer.down_proj)


@pytest.mark.parametrize("layout", [dict(dp=4, ep=2), dict(dp=2, sp=2, ep=4)], ids=["ep2-edp2", "ep4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32-grouped", "fp64-loop"])
def test_experts_ep_equals_transformers_experts(layout, dtype):
    grouped = run_on_ranks(experts_against_serial, WORLD, layout, 8, dtype)
    assert all(grouped) == (dtype == torch.float32)  # fp32: one grouped matmul; fp64: the loop


def rank_without_rows(_):
    """Every token of every rank routed to the experts of ep rank 0: ep rank 1 receives no row,
    sends and receives empty exchanges, and the outputs still equal the serial module's."""
    mesh = cached_mesh(dp=4, ep=2)
    serial = _tiny_experts(4, torch.float32)
    layer = ExpertsEP.from_serial(copy.deepcopy(serial), mesh)
    x, _, weights = routing(mesh.rank("dp", "sp"), 4)
    index = torch.tensor([[0, 1]]).expand(x.shape[0], -1)
    out = layer(x, index, weights)
    out.sum().backward()
    expected = serial(x, index, weights)
    twin = copy.deepcopy(serial).double()(x.double(), index, weights.double())
    assert_close_conditioned(out.detach(), expected.detach(), twin.detach(), "experts output, a rank with no row",
                             terms=model_terms(hidden=HIDDEN, layers=1, seq=1, tokens=x.shape[0] * TOP_K, ffn=FFN))
    return [p.grad is None or not p.grad.any() for p in layer.parameters()]


def test_a_rank_whose_experts_receive_no_row_exchanges_nothing():
    unused = run_on_ranks(rank_without_rows, WORLD, 0)
    assert [all(u) for u in unused] == [False, True, False, True]  # ep rank 1's experts got no token


def refuse_ep_not_dividing_experts(_):
    mesh = cached_mesh(dp=4, ep=4)
    with pytest.raises(ValueError) as err:
        ExpertsEP.from_serial(_tiny_experts(6, torch.float32), mesh)
    return str(err.value)


def test_ep_not_dividing_the_experts_is_refused():
    message = run_on_ranks(refuse_ep_not_dividing_experts, WORLD, 0)[0]
    assert "ep=4" in message and "6 experts" in message and "divides 6" in message
