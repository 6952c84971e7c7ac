"""Activation placements of 2D / 2.5D / 3D: shard / gather round trips, the batch rule, the table
of canonical placements, and the patch-embedding dropout streams. The layer tests themselves:
test_layers_grid.py and test_grid_chaining.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardzoo.layers import placements
from shardzoo.testing import run_on_ranks
from shardzoo.testing.grid import BATCH_PARTS, classes, hidden_parts_of, mesh_of, world_of
from shardzoo.testing.serial_twin import randn


# -- placement round trips -----------------------------------------------------------------
def check_placement_round_trip(name, shape, seed):
    mesh = mesh_of(name)
    placement = placements.canonical_placement(mesh)
    x = randn(seed, shape, torch.float64).requires_grad_(True)
    local = placements.shard_activation(x, mesh, placement)
    parts = placement.batch_parts(mesh)
    q = mesh.size(placement.hidden_axis)
    assert local.shape == (shape[0] // parts, *shape[1:-1], shape[-1] // q)
    b, h = placement.batch_index(mesh), mesh.rank(placement.hidden_axis)
    expected = x.detach().chunk(parts, 0)[b].chunk(q, -1)[h]
    assert torch.equal(local.detach(), expected)
    back = placements.gather_activation(local * 2, mesh, placement)
    assert torch.equal(back.detach(), 2 * x.detach())
    back.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    if mesh.tp_mode == "3d":  # the swapped placement of a 3D layer's output round-trips too
        swapped = placements.swapped_3d(placement)
        y = placements.gather_activation(placements.shard_activation(x.detach(), mesh, swapped), mesh, swapped)
        assert torch.equal(y, x.detach())
    return b


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
@settings(max_examples=5)
@given(data=st.data())
def test_placement_round_trip(name, data):
    parts = BATCH_PARTS[name]
    q = 2
    shape = [parts * data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), q * data.draw(st.integers(1, 3))]
    blocks = run_on_ranks(check_placement_round_trip, world_of(name), name, shape, data.draw(st.integers(0, 10**6)))
    assert sorted(set(blocks)) == list(range(parts))  # every batch block is held by some rank


def placement_error(name):
    mesh = mesh_of(name)
    try:
        placements.shard_activation(torch.zeros(3, 2, 4), mesh, who="Layer")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_placement_batch_rule_is_named(name):
    messages = run_on_ranks(placement_error, world_of(name), name)
    for m in messages:
        assert m is not None and "Layer needs the batch size (dim 0) divisible by" in m and "got 3" in m


def test_canonical_placements():
    """The table in placements.py, and the 3D swap rule."""
    L = placements.ActivationPlacement
    three = L("3d", ("tp_x", "tp_y"), "tp_z")
    assert placements.swapped_3d(three) == L("3d", ("tp_x", "tp_z"), "tp_y")
    assert placements.swapped_3d(placements.swapped_3d(three)) == three
    assert L("2.5d", ("tp_dep", "tp_row"), "tp_col").param_axes == ("tp_row",)
    assert L("2.5d", ("tp_dep", "tp_row"), "tp_col").replica_axes == ("tp_dep",)
    assert three.param_axes == ("tp_x", "tp_y") and three.replica_axes == ()


def check_patch_dropout(name, seed):
    """PatchEmbedding dropout draws from the per-tp-rank stream: reproducible from the seed,
    a different mask on every tp rank, and off in eval mode."""
    import torch.distributed as dist

    from shardzoo.layers.rng_streams import manual_seed

    mesh = mesh_of(name)
    torch.manual_seed(seed)
    layer = classes(mesh.tp_mode)["patch"](4, 2, 1, 4 * hidden_parts_of(name), mesh=mesh, dropout=0.5)
    pixels = layer.shard_input(torch.ones(2 * BATCH_PARTS[name], 1, 4, 4))
    runs = []
    for _ in range(2):
        manual_seed(mesh, seed)
        runs.append(layer(pixels).detach())
    assert torch.equal(runs[0], runs[1]), "dropout is not reproducible from the seed"
    assert (runs[0] == 0).any() and (runs[0] != 0).any(), "p=0.5 dropped nothing or everything"
    masks = [None] * dist.get_world_size()
    dist.all_gather_object(masks, runs[0] == 0)
    assert len({tuple(m.flatten().tolist()) for m in masks}) == len(masks), "tp ranks drew the same mask"
    layer.eval()
    assert not (layer(pixels) == 0).any()
    return True


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_patch_embedding_dropout_streams(name):
    assert all(run_on_ranks(check_patch_dropout, world_of(name), name, 3))
