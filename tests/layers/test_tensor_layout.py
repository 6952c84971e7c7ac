"""Every kind the layout object builds, in every tp_mode, equals its serial twin.

``layout_of(mesh)`` is the one factory the models use; here each of its kinds (column / row
pair, dense, LayerNorm, RMSNorm, small and vocabulary-parallel embeddings, patch embedding, LM
head, classifier, first token) is built from a serial module and run between the layout's own
``shard_*`` / ``gather_*`` calls: outputs, input gradients and parameter gradients (gathered by
ShardSpec) match serial in float64, on 1D tp=4, 2D, 2.5D (d=2) and 3D meshes.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.layers.patch_embedding_2d import serial_patch_embedding
from shardzoo.layers.tensor_layout import LAYOUTS, layout_of
from shardzoo.testing import assert_close, run_on_ranks
from shardzoo.testing.pools import cached_mesh
from shardzoo.testing.meshes import with_world
from shardzoo.testing.serial_twin import check_grads_match, perturbed, randn

MESHES = {"1d": with_world(tp=4, tp_mode="1d"), "2d": with_world(tp=4, tp_mode="2d"),
          "2.5d": with_world(tp=8, tp_mode="2.5d", tp_depth=2), "3d": with_world(tp=8, tp_mode="3d")}
B, S, H, V, C = 4, 3, 8, 10, 3  # V=10 pads the vocabulary on every grid; H=8 splits q^3 ways in 3D
KINDS = ["pair", "dense", "norm", "rms_norm", "embedding", "vocab_embedding", "patch_embedding", "lm_head",
         "classifier", "first_token"]


class Pair(nn.Module):
    """fc2(gelu(fc1(x))): the same code for the serial and the parallel pair."""

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SerialPatch(nn.Module):
    """Hugging Face ViTEmbeddings' forward on ``serial_patch_embedding``'s parameters."""

    def __init__(self, inner):
        super().__init__()
        self.cls_token, self.position_embeddings = inner.cls_token, inner.position_embeddings
        self.patch_embeddings = inner.patch_embeddings

    def forward(self, pixels):
        patches = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(len(pixels), -1, -1), patches], 1) + self.position_embeddings


def build(kind, layout, seed):
    """(serial module, parallel module, parallel forward on the full input, full input)."""
    torch.manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    x = randn(seed + 1, (B, S, H), torch.float64)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed + 2))
    hidden = (layout.shard_input, layout.gather_output)
    if kind == "pair":
        serial = Pair(nn.Linear(H, 2 * H, **f64), nn.Linear(2 * H, H, **f64))
        twin = copy.deepcopy(serial)
        par = Pair(layout.linear(serial=twin.fc1, style="column"), layout.linear(serial=twin.fc2, style="row"))
        return serial, par, hidden, x
    if kind == "dense":
        serial = nn.Linear(H, H, **f64)
        par = layout.dense(serial=copy.deepcopy(serial))
        return serial, par, hidden, x
    if kind in ("norm", "rms_norm"):
        serial = perturbed(nn.LayerNorm(H, **f64) if kind == "norm" else nn.RMSNorm(H, eps=1e-5, **f64), seed)
        par = getattr(layout, kind)(serial=copy.deepcopy(serial))
        return serial, par, hidden, x
    if kind in ("embedding", "vocab_embedding"):
        serial = nn.Embedding(V, H, **f64)
        par = getattr(layout, kind)(serial=copy.deepcopy(serial))
        return serial, par, (layout.shard_batch, layout.gather_output), ids
    if kind == "patch_embedding":
        inner = serial_patch_embedding(4, 2, 1, H, dtype=torch.float64)
        par = layout.patch_embedding(serial=copy.deepcopy(inner))
        pixels = randn(seed + 3, (B, 1, 4, 4), torch.float64)
        return SerialPatch(inner), par, (layout.shard_batch, layout.gather_output), pixels
    if kind == "lm_head":
        serial = nn.Linear(H, V, bias=False, **f64)
        par = layout.lm_head(serial=copy.deepcopy(serial))
        return serial, par, (layout.shard_input, par.gather_output), x
    if kind == "classifier":
        serial = nn.Linear(H, C, **f64)
        par = layout.classifier(serial=copy.deepcopy(serial))
        return serial, par, (layout.shard_input, lambda y: layout.gather_batch(y, layout.after(par))), x
    assert kind == "first_token"
    first = lambda t: t[:, 0]  # noqa: E731
    return None, None, (layout.shard_input, lambda y: layout.gather_output(y)), x, first


def check_kinds(mode, seed):
    mesh = cached_mesh(**MESHES[mode][0])
    layout = layout_of(mesh)
    assert type(layout) is LAYOUTS[mode] and layout_of(mesh) is layout, "one layout object per mesh"
    for kind in KINDS:
        built = build(kind, layout, seed)
        serial, par, (enter, leave), x_full = built[:4]
        run = built[4] if kind == "first_token" else None
        float_input = x_full.is_floating_point()
        xs, xp = (x_full.clone().requires_grad_(float_input) for _ in range(2))
        if kind == "first_token":
            ys, y = run(xs), leave(layout.first_token(enter(xp)))
        elif kind == "dense":
            ys, y = serial(xs), leave(layout.change_placement(par(enter(xp)), layout.after(par), layout.activation))
        else:
            ys, y = serial(xs), leave(par(enter(xp)))
        g = randn(seed + 4, ys.shape, ys.dtype)
        # every kind reduces over at most its widths and the tokens (B, S, H, V, C of this file)
        tol = dict(terms=H + V + B * S, parts=mesh.tp_size)
        assert_close(y.detach(), ys.detach(), f"{mode} {kind} output", **tol)
        (ys * g).sum().backward()
        (y * g).sum().backward()
        if float_input:
            assert_close(xp.grad, xs.grad, f"{mode} {kind} input grad", **tol)
        if par is not None:
            check_grads_match(par, serial, mesh, f"{mode} {kind}", terms=tol["terms"])
    return True


@pytest.mark.parametrize("mode", list(MESHES))
def test_every_kind_in_every_mode_equals_serial(mode):
    assert all(run_on_ranks(check_kinds, MESHES[mode][1], mode, 5))


def test_layout_of_refuses_what_is_not_a_mesh():
    with pytest.raises(ValueError, match="layout_of needs a ParallelMesh"):
        layout_of(object())


def closed_mesh_is_freed():
    """A mesh whose layout object and RNG streams were made is collected once closed and
    dropped (each refers to its mesh, so a cache keyed weakly by the mesh kept every one alive,
    with its process groups' threads)."""
    import gc
    import weakref

    from shardzoo import ParallelMesh
    from shardzoo.layers.rng_streams import rng_streams

    mesh = ParallelMesh(tp=2)
    layout_of(mesh), rng_streams(mesh)
    ref = weakref.ref(mesh)
    mesh.close()
    del mesh
    gc.collect()
    return ref() is None


def test_layout_and_streams_do_not_keep_a_closed_mesh_alive():
    assert run_on_ranks(closed_mesh_is_freed, 2) == [True, True]
