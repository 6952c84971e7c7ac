"""Packed documents and grouped-query attention, ring and Ulysses, against serial SDPA per document.

Every rank builds the full packed inputs from the seed, runs the per-document reference in fp32
and fp64, shards with ``cu_seqlens``, attends over the sp group (with tp: over its heads),
gathers and back-propagates; out, dq, dk, dv (and the lse) must match in fp32."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardzoo import comm
from shardzoo.layers.packing import cu_seqlens_from_position_ids, split_documents
from shardzoo.layers.ring_attention import ring_attention
from shardzoo.layers.sequence import gather_sequence, shard_sequence
from shardzoo.layers.ulysses import ulysses_attention
from shardzoo.testing import cached_mesh, error_messages, run_on_ranks
from shardzoo.testing.packed_attention import (compare_packed, long_tailed_lengths, offsets, packed_inputs,
                                               parallel_grads, serial_grads)

ATTENTIONS = {"ring": ring_attention, "ulysses": ulysses_attention}


def check_packed(mode, lengths, heads, kv_heads, causal, tp, seed, with_lse=False, dense=False):
    """``heads`` / ``kv_heads`` per tp rank; tp ranks take consecutive head blocks of both."""
    mesh = cached_mesh(sp=torch.distributed.get_world_size() // tp, tp=tp)
    q, k, v, dout, lse_weight = packed_inputs(1, heads * tp, kv_heads * tp, sum(lengths), 16, seed)
    t = mesh.tp_rank
    q, dout, lse_weight = (x[:, t * heads : (t + 1) * heads] for x in (q, dout, lse_weight))
    k, v = (x[:, t * kv_heads : (t + 1) * kv_heads] for x in (k, v))
    expected = serial_grads(q, k, v, dout, lse_weight, lengths, causal, torch.float32, with_lse)
    exact = serial_grads(q, k, v, dout, lse_weight, lengths, causal, torch.float64, with_lse)
    f32 = [x.float() for x in (q, k, v, dout)]
    actual = parallel_grads(ATTENTIONS[mode], *f32, lse_weight, lengths, causal, mesh.sp_group, with_lse, dense,
                            **({"return_lse": True} if with_lse else {}))
    names = ("out", "lse", "dq", "dk", "dv") if with_lse else ("out", "dq", "dk", "dv")
    compare_packed(actual, expected, exact, f"{mode} sp={mesh.sp_size} tp={tp} {lengths} {heads}:{kv_heads} "
                   f"causal={causal}", names)


@st.composite
def packed_case(draw, world, mode):
    # lengths from 1 (inside one chunk) to 3 * 2P (spanning every rank)
    lengths = draw(st.lists(st.integers(1, 6 * world), min_size=1, max_size=4))
    ratio = draw(st.sampled_from([1, 2, 4]))
    if mode == "ring":
        kv_heads = draw(st.integers(1, 2))
    else:  # Ulysses: heads % P == 0, and kv heads a multiple or a divisor of P
        kv_heads = draw(st.sampled_from([n for n in (1, 2, 4) if (n * ratio) % world == 0]))
    return mode, lengths, kv_heads * ratio, kv_heads, draw(st.booleans()), 1, draw(st.integers(0, 10**6))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@settings(max_examples=12)
@given(data=st.data())
def test_packed_gqa_matches_per_document_sdpa(world, mode, data):
    run_on_ranks(check_packed, world, *data.draw(packed_case(world, mode)))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_gqa_matches_sdpa(world, mode, ratio, causal):
    """Grouped-query attention without documents: one dense sequence, zigzag shards when causal."""
    kv_heads = 2 if mode == "ring" else world
    run_on_ranks(check_packed, world, mode, [4 * world], kv_heads * ratio, kv_heads, causal, 1, ratio, False, True)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_gqa_with_tensor_parallel_heads(mode, causal):
    """tp=2 x sp=2, 4:1 grouped-query attention per tp rank; length-1 documents and one that
    spans both sp ranks."""
    run_on_ranks(check_packed, 4, mode, [1, 13, 1, 6], 4 if mode == "ring" else 2, 1, causal, 2, 5)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_return_lse_and_its_gradient(world, causal):
    """(out, lse) from return_lse=True, with a loss on both: lse and every gradient match."""
    run_on_ranks(check_packed, world, "ring", [1, 3 * world + 1, 2], 2, 1, causal, 1, 3, True)


@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), world=st.sampled_from([1, 2, 3, 4]))
@example(lengths=[1], world=4)
def test_split_holds_every_token_once_and_balances_tokens(lengths, world):
    split = split_documents(tuple(lengths), world)
    held = torch.cat([split.positions(r) for r in range(world)])
    assert sorted(held.tolist()) == list(range(sum(lengths)))
    sizes = [split.local_len(r) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1  # leftover tokens go round-robin across documents
    for r in range(world):  # local order is document order, and each window is its document's
        pos = split.positions(r)
        assert torch.equal(pos, pos.sort().values)


@settings(max_examples=10)
@given(seed=st.integers(0, 10**6), world=st.sampled_from([2, 4]), causal=st.booleans())
def test_split_balances_attention_work_for_the_benchmark_lengths(seed, world, causal):
    """Largest rank's visible (query, key) pairs at most 1.1x the mean, 32k tokens of the
    benchmark's long-tailed document lengths; the pairs are counted from the split's windows and
    checked here against a brute-force count over the mask."""
    lengths = long_tailed_lengths(32768, seed)
    split = split_documents(tuple(lengths), world)
    work = split.work(causal)
    assert max(work) <= 1.1 * sum(work) / world, (work, lengths)
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    start = torch.tensor([0] + lengths[:-1]).cumsum(0)
    position_in_doc = torch.arange(sum(lengths)) - start[doc_of]
    for r in range(world):
        pos = split.positions(r)
        visible = position_in_doc[pos] + 1 if causal else torch.tensor(lengths)[doc_of[pos]]
        assert int(visible.sum()) == work[r]


def check_shard_gather_packed(lengths, dim):
    group = cached_mesh(sp=torch.distributed.get_world_size()).sp_group
    cu = offsets(lengths)
    shape = [2, 3, 2]
    shape.insert(dim, sum(lengths))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(lengths)), dtype=torch.float64)
    x.requires_grad_(True)
    local = shard_sequence(x, group, dim, cu_seqlens=cu)
    full = gather_sequence(local, group, dim, cu_seqlens=cu)
    assert torch.equal(full.detach(), x.detach())
    weights = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (full * weights).sum().backward()  # the same loss on every rank: gradient = weights
    assert torch.equal(x.grad, weights)


@pytest.mark.parametrize("world", [2, 4])
def test_shard_and_gather_packed_round_trip_and_gradient(world):
    run_on_ranks(check_shard_gather_packed, world, [1, 9, 2, 5], 1)
    run_on_ranks(check_shard_gather_packed, world, [7], 3)


def test_cu_seqlens_from_position_ids():
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(position_ids).tolist() == [0, 3, 4, 8]
    assert cu_seqlens_from_position_ids(position_ids).dtype == torch.int32
    with pytest.raises(ValueError, match="must start at 0"):
        cu_seqlens_from_position_ids(torch.tensor([[1, 2, 0]]))


def check_position_ids_equal_cu_seqlens(mode):
    """transformers' packed position_ids give the same result as the cu_seqlens they encode."""
    group = cached_mesh(sp=torch.distributed.get_world_size()).sp_group
    lengths = [3, 1, 6]
    cu = offsets(lengths)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    q, k, v, _, _ = packed_inputs(1, 2, 1, sum(lengths), 16, 0)
    q, k, v = (shard_sequence(t.float(), group, 2, cu_seqlens=cu) for t in (q, k, v))
    by_cu = ATTENTIONS[mode](q, k, v, group=group, causal=True, cu_seqlens=cu)
    by_pos = ATTENTIONS[mode](q, k, v, group=group, causal=True, position_ids=position_ids)
    assert torch.equal(by_cu, by_pos)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_position_ids_are_accepted_as_packed_format(mode):
    run_on_ranks(check_position_ids_equal_cu_seqlens, 2, mode)


def bad_packed_calls():
    group = cached_mesh(sp=2).sp_group
    q = torch.randn(1, 2, 4, 8)
    return error_messages((
        lambda: ring_attention(q, q, q, group=group, cu_seqlens=torch.tensor([0, 8])),  # int64
        lambda: ring_attention(q, q, q, group=group, cu_seqlens=torch.tensor([0, 3, 3, 8], dtype=torch.int32)),
        lambda: ring_attention(q, q, q, group=group, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)),
        lambda: ring_attention(q, q[:, :1].expand(1, 3, 4, 8), q[:, :1].expand(1, 3, 4, 8), group=group),
    ))


def test_bad_packed_arguments_raise_clear_errors():
    dtype, empty_doc, wrong_split, heads = run_on_ranks(bad_packed_calls, 2)[0]
    assert "int32" in dtype and "torch.int64" in dtype
    assert "increase strictly" in empty_doc and "[0, 3, 3, 8]" in empty_doc
    assert "holds 4 tokens" in wrong_split and "gives it" in wrong_split and "shard_sequence" in wrong_split
    assert "2 heads and k / v 3" in heads and "H % H_kv == 0" in heads


def count_gqa_bytes(mode, heads, kv_heads, packed):
    """Bytes this rank sends in forward and backward, with the inputs' sizes for the formula."""
    world = torch.distributed.get_world_size()
    group = cached_mesh(sp=world).sp_group
    lengths = [5, 1, 8 * world + 3] if packed else [8 * world]
    cu = offsets(lengths) if packed else None
    local = split_documents(tuple(lengths), world).max_len if packed else 8
    q = torch.randn(2, heads, shard_len(lengths, packed), 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, q.shape[2], 16, requires_grad=True) for _ in range(2))
    with comm.count() as forward:
        out = ATTENTIONS[mode](q, k, v, group=group, causal=True, cu_seqlens=cu)
    with comm.count() as backward:
        out.sum().backward()
    return forward.bytes, backward.bytes, local, world


def shard_len(lengths, packed):
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return split_documents(tuple(lengths), world).local_len(rank) if packed else lengths[0] // world


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize("packed", [False, True])
def test_ring_gqa_sends_exact_bytes(world, heads, kv_heads, packed):
    """Ring, per rank: forward (P-1) hops of K + V with kv_heads heads at the longest shard's
    length L; backward the same plus P hops of fp32 dK + dV. No query head ever travels."""
    for fwd, bwd, width, p in run_on_ranks(count_gqa_bytes, world, "ring", heads, kv_heads, packed):
        kv = 2 * 2 * kv_heads * width * 16 * 4  # K + V: batch 2, head_dim 16, fp32
        assert fwd == {"send": (p - 1) * kv}
        assert bwd == {"send": (p - 1) * kv + p * kv}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2), (4, 4), (8, 4)])
@pytest.mark.parametrize("packed", [False, True])
def test_ulysses_gqa_sends_exact_bytes(world, heads, kv_heads, packed):
    """Ulysses, per rank and direction: all-to-alls of (P-1)/P * B * L * d * 4 bytes times
    (2 * heads + 2 * P * max(kv_heads / P, 1)): q and out, and each kv head once per rank
    that reads it."""
    from fractions import Fraction

    for fwd, bwd, width, p in run_on_ranks(count_gqa_bytes, world, "ulysses", heads, kv_heads, packed):
        expected = Fraction(p - 1, p) * 2 * width * 16 * 4 * (2 * heads + 2 * p * max(kv_heads // p, 1))
        assert fwd == {"all_to_all": expected} and bwd == {"all_to_all": expected}


def check_packed_dropout(mode):
    """Dropout with packed documents: the stateless mask of the global positions, so the result
    equals single-rank flash_attention per document with the same seed (fp64)."""
    from shardzoo.kernels import flash_attention

    group = cached_mesh(sp=torch.distributed.get_world_size()).sp_group
    lengths, seed, p = [3, 1, 11, 5], 2**33 + 5, 0.25
    q, k, v, dout, _ = packed_inputs(1, 4, 2, sum(lengths), 16, 7)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    outs, start = [], 0
    for n in lengths:
        part, pos = slice(start, start + n), torch.arange(start, start + n)
        kd, vd = (t[:, :, part].repeat_interleave(2, 1) for t in leaves[1:])
        outs.append(flash_attention(leaves[0][:, :, part], kd, vd, causal=True, dropout_p=p, dropout_seed=seed,
                                    q_positions=pos, k_positions=pos))
        start += n
    torch.cat(outs, 2).backward(dout)
    expected = (torch.cat(outs, 2).detach(),) + tuple(t.grad for t in leaves)
    actual = parallel_grads(ATTENTIONS[mode], q, k, v, dout, None, lengths, True, group, False, dropout_p=p,
                            dropout_seed=seed)
    compare_packed(actual, expected, expected, f"{mode} packed dropout")


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_packed_dropout_matches_single_rank(mode):
    run_on_ranks(check_packed_dropout, 2, mode)
