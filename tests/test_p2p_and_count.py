"""p2p send/recv and the ring exchange; exact byte accounting of every op."""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from shardzoo import ParallelMesh, comm
from shardzoo.comm.p2p import RingExchange, recv, send
from shardzoo.testing import run_on_ranks


def send_recv_in_subgroup(shape, dtype_name, seed):
    """Inside each tp group of a dp=2 x tp=2 mesh, member 0 sends to member 1 (group ranks)."""
    mesh = ParallelMesh(dp=2, tp=2)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed + mesh.dp_rank)
    x = (torch.randn(shape, generator=g) * 10).to(dtype)
    if mesh.tp_rank == 0:
        send(x, 1, mesh.tp_group)
        return None
    got = recv(0, mesh.tp_group)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, x)
    return tuple(got.shape)


@given(
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
    dtype=st.sampled_from(["float32", "bfloat16", "int64", "bool", "float64"]),
    seed=st.integers(0, 1000),
)
def test_send_recv_carries_shape_and_dtype(shape, dtype, seed):
    results = run_on_ranks(send_recv_in_subgroup, 4, shape, dtype, seed)
    assert results[1] == tuple(shape) and results[3] == tuple(shape)


def ring_exchange(steps, reverse):
    p, r = dist.get_world_size(), dist.get_rank()
    ring = RingExchange(dist.group.WORLD, reverse=reverse)
    k, mask = torch.full((2, 3), float(r)), torch.tensor([r % 2 == 0, True])
    origins = []
    for _ in range(steps):
        pending = ring.start([k, mask])
        k, mask = pending.wait()
        origins.append(int(k[0, 0]))
        assert bool(mask[0]) == (origins[-1] % 2 == 0)
    step = -1 if reverse else 1
    assert origins == [(r - step * (i + 1)) % p for i in range(steps)]
    return origins[-1]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("reverse", [False, True])
def test_ring_exchange_visits_every_rank_and_returns_home(world, reverse):
    # After `world` steps every block has travelled the whole ring and is back home.
    assert run_on_ranks(ring_exchange, world, world, reverse) == list(range(world))


def ring_swap(reverse, chunk_bytes):
    """swap() overwrites in place with the previous rank's tensors, chunk by chunk, and sends
    exactly their bytes; returns the origins seen over a full trip."""
    p, r = dist.get_world_size(), dist.get_rank()
    ring = RingExchange(dist.group.WORLD, reverse=reverse)
    grad = torch.arange(37, dtype=torch.float64) + 1000 * r  # 37: chunks do not divide it evenly
    flag = torch.tensor([r, -r], dtype=torch.int64)
    storage = grad.data_ptr()
    origins = []
    with comm.count() as c:
        for _ in range(p):
            ring.swap([grad, flag], chunk_bytes=chunk_bytes)
            origin = int(grad[0]) // 1000
            assert torch.equal(grad, torch.arange(37, dtype=torch.float64) + 1000 * origin)
            assert flag.tolist() == [origin, -origin]
            origins.append(origin)
    assert grad.data_ptr() == storage
    sent = c.bytes.get("send", 0)
    assert sent == (p * (37 * 8 + 2 * 8) if p > 1 else 0)
    return origins


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("reverse,chunk_bytes", [(False, 40), (True, 1 << 20)])
def test_ring_swap_replaces_in_place_and_returns_home(world, reverse, chunk_bytes):
    step = -1 if reverse else 1
    for r, origins in enumerate(run_on_ranks(ring_swap, world, reverse, chunk_bytes)):
        assert origins == [(r - step * (i + 1)) % world for i in range(world)]


def test_ring_swap_rejects_non_contiguous_tensors():
    with pytest.raises(ValueError, match=r"contiguous tensors .* shape \(6, 4\)"):
        RingExchange(None).swap([torch.zeros(4, 6).t()])


def count_every_op():
    p = dist.get_world_size()
    group = dist.group.WORLD
    x = torch.ones(4 * p, 6, requires_grad=True)  # 24p floats = 96p bytes
    n = x.numel() * 4
    with comm.count() as c:
        comm.reduce_from(x, group).sum().backward()  # all_reduce n, backward nothing
        comm.copy_to(x, group).sum().backward()  # backward all_reduce n
        comm.gather_from(x, group, 0).sum().backward()  # all_gather p*n
        comm.all_gather(x, group, 0).sum().backward()  # all_gather p*n, reduce_scatter p*n
        comm.reduce_scatter(x, group, 0).sum().backward()  # reduce_scatter n, all_gather n
        comm.all_to_all(x, group, 0, 1).sum().backward()  # all_to_all n twice
        comm.broadcast(x, group, 0).sum().backward()  # broadcast n, reduce n
        ring = RingExchange(group)
        ring.start([x.detach()]).wait()  # send n
    f = Fraction(p - 1, p)
    expected = {
        "all_reduce": 2 * f * 2 * n,
        "all_gather": f * (2 * p * n + n),
        "reduce_scatter": f * (p * n + n),
        "all_to_all": f * 2 * n,
        "broadcast": f * n,
        "reduce": f * n,
        "send": Fraction(n) if p > 1 else Fraction(0),
    }
    got = c.bytes
    for kind, value in expected.items():
        assert got.get(kind, Fraction(0)) == value, (kind, got.get(kind), value)
    return c.calls


@pytest.mark.parametrize("world", [2, 4])
def test_count_matches_ring_byte_model_exactly(world):
    calls = run_on_ranks(count_every_op, world)[0]
    assert calls["all_gather"] == 3 and calls["send"] == 1


def test_count_records_nothing_outside_block():
    with comm.count() as c:
        pass
    assert c.bytes == {} and c.total_bytes == 0
