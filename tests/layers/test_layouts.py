"""Activation layouts of 2D / 2.5D / 3D, and the parallel-vs-serial harness the layer tests share.

Every check runs on all ranks: each rank builds the serial twin from the same seed, runs the
parallel module between ``shard_input`` and ``gather_output`` and compares full-size outputs,
input gradients and every parameter gradient gathered to full size with its ShardSpec.
With dp > 1 each data-parallel replica draws its own batch and is compared with the serial
module on that batch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers import layouts
from shardzoo.layers.shard_spec import full_state_dict, gather_full, get_shard_spec
from shardzoo.testing import assert_close, assert_close_conditioned, cached_mesh, run_on_ranks

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# name -> (ParallelMesh kwargs, world size)
MESHES = {
    "2d": (dict(tp=4, tp_mode="2d"), 4),
    "2d_dp2": (dict(dp=2, tp=4, tp_mode="2d"), 8),
    "2d_sp2": (dict(sp=2, tp=4, tp_mode="2d"), 8),
    "2.5d": (dict(tp=8, tp_mode="2.5d", tp_depth=2), 8),
    "2.5d_d1": (dict(tp=4, tp_mode="2.5d", tp_depth=1), 4),
    "3d": (dict(tp=8, tp_mode="3d"), 8),
}
BATCH_PARTS = {"2d": 2, "2d_dp2": 2, "2d_sp2": 2, "2.5d": 4, "2.5d_d1": 2, "3d": 4}
SCALE = 8  # tolerance multiple: block sums add in a different order than serial


def mesh_of(name):
    return cached_mesh(**MESHES[name][0])


def world_of(name):
    return MESHES[name][1]


def randn(seed, shape, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def data_seed(seed, mesh):
    """Each data-parallel replica and sequence-parallel rank draws its own data."""
    return seed + 1000 * (mesh.rank("dp", "sp") + 1)


def check_state_matches(par, serial, what):
    state = full_state_dict(par)
    ref = serial.state_dict()
    assert state.keys() == ref.keys(), f"{what}: state keys {sorted(state)} != {sorted(ref)}"
    for k, v in ref.items():
        assert torch.equal(state[k], v), f"{what}: initial {k} differs from serial"
    for n, p in par.named_parameters():
        assert get_shard_spec(par, n) is not None, f"{what}: parameter {n} has no ShardSpec"


def check_grads_match(par, serial, mesh, what, scale=SCALE):
    ref = dict(serial.named_parameters())
    for n, p in par.named_parameters():
        assert p.grad is not None, f"{what}: {n} got no gradient"
        assert_close(gather_full(p.grad, get_shard_spec(par, n), mesh), ref[n].grad, f"{what} grad {n}", scale)


def compare_module(par, serial, mesh, x_full, what, loss_weight_seed):
    """Forward + backward of ``par`` (through shard_input / gather_output) against ``serial``
    on input ``x_full``; a fixed random output weighting makes every gradient non-trivial."""
    float_input = x_full.is_floating_point()
    xs = x_full.clone().requires_grad_(float_input)
    ys = serial(xs)
    g = randn(loss_weight_seed, ys.shape, ys.dtype)
    (ys * g).sum().backward()
    # the same serial math in float64: how far the serial result itself is from exact
    x64 = x_full.detach().double().clone().requires_grad_(True) if float_input else x_full
    y64 = copy.deepcopy(serial).double()(x64)
    (y64 * g.double()).sum().backward()
    xp = x_full.clone().requires_grad_(float_input)
    y = par.gather_output(par(par.shard_input(xp)))
    assert_close_conditioned(y, ys.detach(), y64.detach(), f"{what} output", SCALE)
    (y * g).sum().backward()
    if float_input:
        assert_close_conditioned(xp.grad, xs.grad, x64.grad, f"{what} input grad", SCALE)
    check_grads_match(par, serial, mesh, what)
    return tuple(y.shape)


# -- layout round trips --------------------------------------------------------------------
def check_layout_round_trip(name, shape, seed):
    mesh = mesh_of(name)
    layout = layouts.canonical_layout(mesh)
    x = randn(seed, shape, torch.float64).requires_grad_(True)
    local = layouts.shard_activation(x, mesh, layout)
    parts = layout.batch_parts(mesh)
    q = mesh.size(layout.hidden_axis)
    assert local.shape == (shape[0] // parts, *shape[1:-1], shape[-1] // q)
    b, h = layout.batch_index(mesh), mesh.rank(layout.hidden_axis)
    expected = x.detach().chunk(parts, 0)[b].chunk(q, -1)[h]
    assert torch.equal(local.detach(), expected)
    back = layouts.gather_activation(local * 2, mesh, layout)
    assert torch.equal(back.detach(), 2 * x.detach())
    back.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    if mesh.tp_mode == "3d":  # the swapped layout of a 3D layer's output round-trips too
        swapped = layouts.swapped_3d(layout)
        y = layouts.gather_activation(layouts.shard_activation(x.detach(), mesh, swapped), mesh, swapped)
        assert torch.equal(y, x.detach())
    return b


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
@settings(max_examples=5)
@given(data=st.data())
def test_layout_round_trip(name, data):
    parts = BATCH_PARTS[name]
    q = 2
    shape = [parts * data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), q * data.draw(st.integers(1, 3))]
    blocks = run_on_ranks(check_layout_round_trip, world_of(name), name, shape, data.draw(st.integers(0, 10**6)))
    assert sorted(set(blocks)) == list(range(parts))  # every batch block is held by some rank


def layout_error(name):
    mesh = mesh_of(name)
    try:
        layouts.shard_activation(torch.zeros(3, 2, 4), mesh, who="Layer")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_layout_batch_rule_is_named(name):
    messages = run_on_ranks(layout_error, world_of(name), name)
    for m in messages:
        assert m is not None and "Layer needs the batch size (dim 0) divisible by" in m and "got 3" in m


def test_canonical_layouts():
    """The table in layouts.py, and the 3D swap rule."""
    L = layouts.ActivationLayout
    three = L("3d", ("tp_x", "tp_y"), "tp_z")
    assert layouts.swapped_3d(three) == L("3d", ("tp_x", "tp_z"), "tp_y")
    assert layouts.swapped_3d(layouts.swapped_3d(three)) == three
    assert L("2.5d", ("tp_dep", "tp_row"), "tp_col").param_axes == ("tp_row",)
    assert L("2.5d", ("tp_dep", "tp_row"), "tp_col").replica_axes == ("tp_dep",)
    assert three.param_axes == ("tp_x", "tp_y") and three.replica_axes == ()


# -- the layer classes of each mode ---------------------------------------------------------
def classes(mode):
    """Layer classes of ``mode`` ("2d", "2.5d", "3d") by kind."""
    from shardzoo.layers import (embedding_2d, embedding_2p5d, embedding_3d, head_2d, head_2p5d, head_3d,
                                 linear_2d, linear_2p5d, linear_3d, norm_2d, norm_2p5d, norm_3d, patch_embedding_2d)

    if mode == "2d":
        return dict(linear=linear_2d.ParallelLinear2D, norm=norm_2d.LayerNorm2D, embedding=embedding_2d.Embedding2D,
                    vocab_embedding=embedding_2d.VocabParallelEmbedding2D, classifier=head_2d.Classifier2D,
                    lm_head=head_2d.LMHead2D, patch=patch_embedding_2d.PatchEmbedding2D,
                    linear_2p5d=linear_2p5d.ParallelLinear2p5D)
    if mode == "2.5d":
        return dict(linear=linear_2p5d.ParallelLinear2p5D, norm=norm_2p5d.LayerNorm2p5D,
                    embedding=embedding_2p5d.Embedding2p5D, vocab_embedding=embedding_2p5d.VocabParallelEmbedding2p5D,
                    classifier=head_2p5d.Classifier2p5D, lm_head=head_2p5d.LMHead2p5D,
                    patch=embedding_2p5d.PatchEmbedding2p5D)
    return dict(linear=linear_3d.ParallelLinear3D, norm=norm_3d.LayerNorm3D, embedding=embedding_3d.Embedding3D,
                vocab_embedding=embedding_3d.VocabParallelEmbedding3D, classifier=head_3d.Classifier3D,
                lm_head=head_3d.LMHead3D, patch=embedding_3d.PatchEmbedding3D)


def check_linear(case):
    """ParallelLinear{2D,2p5D,3D} against nn.Linear; case: name, in, out, batch, seq, bias,
    dtype, seed, from_serial."""
    mesh = mesh_of(case["name"])
    cls = classes(mesh.tp_mode)["linear"]
    dtype = DTYPES[case["dtype"]]
    torch.manual_seed(case["seed"])
    serial = nn.Linear(case["in"], case["out"], case["bias"], dtype=dtype)
    if case["from_serial"]:
        par = cls.from_serial(serial, mesh)
    else:
        torch.manual_seed(case["seed"])
        par = cls(case["in"], case["out"], case["bias"], mesh=mesh, dtype=dtype)
    assert par.mesh is mesh
    check_state_matches(par, serial, cls.__name__)
    seed = data_seed(case["seed"], mesh)
    x = randn(seed, (case["batch"], case["seq"], case["in"]), dtype)
    return compare_module(par, serial, mesh, x, cls.__name__, seed + 1)


def linear_case(draw, name, q=2):
    """Random shapes satisfying the mode's rule (3D: out divisible by q*q)."""
    out_mult = q * q if name == "3d" else q
    return dict(
        name=name, **{"in": q * draw(st.integers(1, 4))}, out=out_mult * draw(st.integers(1, 3)),
        batch=BATCH_PARTS[name] * draw(st.integers(1, 2)), seq=draw(st.integers(1, 3)), bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)), from_serial=draw(st.booleans()),
    )


def construction_error(name, kind, args, kwargs):
    """The ValueError message a constructor raises on every rank (None if it does not)."""
    mesh = mesh_of(name)
    try:
        classes(mesh.tp_mode)[kind](*args, mesh=mesh, **kwargs)
    except ValueError as e:
        return str(e)
    return None


# -- LayerNorm, embeddings, classifier ------------------------------------------------------
def perturbed(module, seed):
    """``module`` with every parameter replaced by random values (so gradients of affine
    parameters and padding rows are exercised away from the default init)."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(randn(seed + i, p.shape, p.dtype))
    return module


def check_module(case):
    """One module kind against its serial twin; case: name, kind, dims, batch, seq, bias,
    dtype, seed."""
    mesh = mesh_of(case["name"])
    kind, dtype, seed = case["kind"], DTYPES[case["dtype"]], case["seed"]
    cls = classes(mesh.tp_mode)[kind]
    b, s, d = case["batch"], case["seq"], case["dims"]
    torch.manual_seed(seed)
    if kind == "norm":
        serial = perturbed(nn.LayerNorm(d["hidden"], eps=1e-5, elementwise_affine=True, bias=case["bias"], dtype=dtype), seed)
        x = randn(data_seed(seed, mesh), (b, s, d["hidden"]), dtype)
    elif kind in ("embedding", "vocab_embedding"):
        serial = perturbed(nn.Embedding(d["vocab"], d["hidden"], padding_idx=d.get("padding_idx"), dtype=dtype), seed)
        if serial.padding_idx is not None:
            with torch.no_grad():
                serial.weight[serial.padding_idx] = 0
        ids = torch.randint(0, d["vocab"], (b, s), generator=torch.Generator().manual_seed(data_seed(seed, mesh)))
        x = ids
    elif kind == "classifier":
        serial = perturbed(nn.Linear(d["hidden"], d["classes"], case["bias"], dtype=dtype), seed)
        x = randn(data_seed(seed, mesh), (b, d["hidden"]), dtype)
    else:
        raise AssertionError(kind)
    par = cls.from_serial(serial, mesh)
    check_state_matches(par, serial, cls.__name__)
    return compare_module(par, serial, mesh, x, cls.__name__, data_seed(seed, mesh) + 1)


def check_default_init(name, kind, args, seed):
    """The default constructor draws exactly what the serial module would."""
    mesh = mesh_of(name)
    cls = classes(mesh.tp_mode)[kind]
    serial_cls = {"norm": nn.LayerNorm, "embedding": nn.Embedding, "vocab_embedding": nn.Embedding,
                  "classifier": nn.Linear, "lm_head": nn.Linear}[kind]
    torch.manual_seed(seed)
    serial = serial_cls(*args)
    torch.manual_seed(seed)
    check_state_matches(cls(*args, mesh=mesh), serial, cls.__name__)
    return True


# -- LM head with the vocab-parallel cross entropy ------------------------------------------
def check_lm(case):
    """ids -> VocabParallelEmbedding -> LM head (tied or not) -> vocab-parallel cross entropy,
    against nn.Embedding / nn.Linear / F.cross_entropy. case: name, vocab, hidden, batch, seq,
    tied, bias, label_smoothing, reduction ("mean", "sum", "none"), dtype, seed."""
    mesh = mesh_of(case["name"])
    kinds = classes(mesh.tp_mode)
    dtype, seed, v, h = DTYPES[case["dtype"]], case["seed"], case["vocab"], case["hidden"]
    torch.manual_seed(seed)
    emb = nn.Embedding(v, h, dtype=dtype)
    head = nn.Linear(h, v, bias=case["bias"] and not case["tied"], dtype=dtype)
    if case["tied"]:
        head.weight = emb.weight
    emb_p = kinds["vocab_embedding"].from_serial(emb, mesh)
    head_p = kinds["lm_head"](h, v, mesh=mesh, tie_to=emb_p) if case["tied"] else kinds["lm_head"].from_serial(head, mesh)
    if case["tied"]:
        assert head_p.weight is emb_p.weight
    dseed = data_seed(seed, mesh)
    gen = torch.Generator().manual_seed(dseed)
    ids = torch.randint(0, v, (case["batch"], case["seq"]), generator=gen)
    target = torch.randint(0, v, (case["batch"], case["seq"]), generator=gen)
    target[0, 0] = -100  # an ignored position
    ls, reduction = case["label_smoothing"], case["reduction"]
    logits = head(emb(ids))
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, label_smoothing=ls,
                           reduction=reduction)
    logits_p = head_p(emb_p(emb_p.shard_input(ids)))
    loss_p = head_p.loss(logits_p, head_p.shard_target(target), label_smoothing=ls, reduction=reduction)
    if reduction == "none":  # this rank's block of per-token losses, batch split as the targets
        assert loss_p.shape == head_p.shard_target(target).shape
        loss_p = layouts.gather_batch(loss_p, mesh, head_p.output_layout).flatten()
    else:
        assert loss_p.dim() == 0
    w = randn(dseed + 1, loss.shape, loss.dtype)  # weights every per-token loss differently
    (loss * w).sum().backward()
    (loss_p * w).sum().backward()
    assert_close(head_p.gather_output(logits_p.detach()), logits.detach(), "logits", SCALE)
    assert_close(loss_p.detach(), loss.detach(), f"loss ({reduction})", SCALE)
    check_grads_match(emb_p, emb, mesh, "embedding")
    if not case["tied"]:
        check_grads_match(head_p, head, mesh, "head")
    return float(loss_p.detach().sum())


# -- ViT patch embedding against a copy of HF ViTEmbeddings ---------------------------------
class ViTEmbeddingsRef(nn.Module):
    """transformers' ViTEmbeddings without mask token / interpolation (same init order)."""

    def __init__(self, image_size, patch_size, channels, hidden, dtype):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden, dtype=dtype))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(channels, hidden, patch_size, stride=patch_size, dtype=dtype)
        self.position_embeddings = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2 + 1, hidden, dtype=dtype))
        self.dropout = nn.Dropout(0.0)

    def forward(self, pixels):
        x = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.position_embeddings
        return self.dropout(x)


def check_patch(case):
    """PatchEmbedding{2D,2p5D,3D} against ViTEmbeddingsRef; case: name, image, patch,
    channels, hidden, batch, dtype, seed, from_serial."""
    mesh = mesh_of(case["name"])
    cls = classes(mesh.tp_mode)["patch"]
    dtype, seed = DTYPES[case["dtype"]], case["seed"]
    torch.manual_seed(seed)
    serial = ViTEmbeddingsRef(case["image"], case["patch"], case["channels"], case["hidden"], dtype)
    if case["from_serial"]:
        par = cls.from_serial(serial, mesh)
    else:
        torch.manual_seed(seed)
        par = cls(case["image"], case["patch"], case["channels"], case["hidden"], mesh=mesh, dtype=dtype)
    check_state_matches(par, serial, cls.__name__)
    x = randn(data_seed(seed, mesh), (case["batch"], case["channels"], case["image"], case["image"]), dtype)
    return compare_module(par, serial, mesh, x, cls.__name__, data_seed(seed, mesh) + 1)


def check_patch_dropout(name, seed):
    """PatchEmbedding dropout draws from the per-tp-rank stream: reproducible from the seed,
    a different mask on every tp rank, and off in eval mode."""
    import torch.distributed as dist

    from shardzoo.layers import random

    mesh = mesh_of(name)
    torch.manual_seed(seed)
    layer = classes(mesh.tp_mode)["patch"](4, 2, 1, 4 * hidden_parts_of(name), mesh=mesh, dropout=0.5)
    pixels = layer.shard_input(torch.ones(2 * BATCH_PARTS[name], 1, 4, 4))
    runs = []
    for _ in range(2):
        random.manual_seed(mesh, seed)
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


# -- hypothesis cases (shapes obey each mode's divisibility rules; q = 2 everywhere) ---------
def hidden_parts_of(name, q=2):
    """Pieces an H-indexed table is cut into: q*q in 2D / 2.5D, q^3 in 3D."""
    return q**3 if name == "3d" else q * q


def module_case(draw, name, kind, q=2):
    hidden = (q if kind in ("norm", "vocab_embedding") else hidden_parts_of(name)) * draw(st.integers(1, 3))
    dims = dict(hidden=hidden)
    if kind in ("embedding", "vocab_embedding"):
        dims["vocab"] = draw(st.integers(2, 13))  # any size: padded where the layout needs it
        dims["padding_idx"] = draw(st.one_of(st.none(), st.integers(0, dims["vocab"] - 1)))
    if kind == "classifier":
        dims["classes"] = draw(st.integers(1, 5))
    return dict(name=name, kind=kind, dims=dims, batch=BATCH_PARTS[name] * draw(st.integers(1, 2)),
                seq=draw(st.integers(1, 3)), bias=draw(st.booleans()), dtype=draw(st.sampled_from(list(DTYPES))),
                seed=draw(st.integers(0, 10**6)))


def lm_case(draw, name, reduction="mean", q=2):
    return dict(name=name, reduction=reduction, vocab=draw(st.integers(2, 19)), hidden=q * draw(st.integers(1, 3)),
                batch=BATCH_PARTS[name] * draw(st.integers(1, 2)), seq=draw(st.integers(1, 3)),
                tied=draw(st.booleans()), bias=draw(st.booleans()), label_smoothing=draw(st.sampled_from([0.0, 0.1])),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)))


def patch_case(draw, name):
    patch = draw(st.integers(1, 3))
    return dict(name=name, image=patch * draw(st.integers(1, 3)), patch=patch, channels=draw(st.integers(1, 3)),
                hidden=hidden_parts_of(name) * draw(st.integers(1, 2)), batch=BATCH_PARTS[name] * draw(st.integers(1, 2)),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)), from_serial=draw(st.booleans()))


def mlp_case(draw, name, q=2):
    hidden_mult = q * q if name == "3d" else q  # 3D: both linears need out_features divisible by q*q
    return dict(name=name, hidden=hidden_mult * draw(st.integers(1, 3)), ffn=q * q * draw(st.integers(1, 3)),
                batch=BATCH_PARTS[name] * draw(st.integers(1, 2)), seq=draw(st.integers(1, 3)),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)))
