"""2D (Optimus / SUMMA), 2.5D (Tesseract) and 3D (Bian et al.) layers against their serial twins.

Meshes (shardzoo.testing.grid): 2D at tp=4 (q=2), also with dp=2 around the grid (each replica
feeds its own data); 2.5D at tp=8 (q=2, d=2) and tp=4 (d=1, where it must behave as 2D); 3D at
tp=8 (q=2). Classifiers tied to an embedding's table: support.tied_classifier.
Chaining and training: test_grid_chaining.py."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardzoo.layers import placements
from shardzoo.testing import assert_close, run_on_ranks
from shardzoo.testing.dtypes import rms_of
from shardzoo.testing.grid import BATCH_PARTS, DTYPES, classes, hidden_parts_of, mesh_of, world_of
from shardzoo.testing.serial_twin import (check_grads_match, check_state_matches, compare_module, data_seed, perturbed,
                                          randn)
from support.tied_classifier import check_checkpoint_round_trip, check_tied_classifier

SUFFIX = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}
KINDS = ["norm", "embedding", "vocab_embedding", "classifier"]


def for_examples(n, check):
    """Run ``check(draw)`` for ``n`` hypothesis examples (the budget differs per mesh)."""
    def one_example(data):
        check(data.draw)  # hypothesis wants None back, whatever the ranks return

    settings(max_examples=n)(given(data=st.data())(one_example))()


# -- ParallelLinear{2D,2p5D,3D} -------------------------------------------------------------
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


@pytest.mark.parametrize("name", ["2d", "2d_dp2", "2.5d", "2.5d_d1", "3d"])
@given(data=st.data())
@settings(max_examples=12)
def test_linear_matches_serial(name, data):
    case = linear_case(data.draw, name)
    shapes = run_on_ranks(check_linear, world_of(name), case)
    assert shapes[0] == (case["batch"], case["seq"], case["out"])


@pytest.mark.parametrize("name,seed", [("2d", 7), ("2.5d", 11), ("3d", 5)])
def test_linear_fixed_largest(name, seed):
    case = dict(name=name, **{"in": 64}, out=96, batch=8, seq=16, bias=True, dtype="fp32", seed=seed, from_serial=False)
    run_on_ranks(check_linear, world_of(name), case)


LINEAR_RULES = [(name, args, f"ParallelLinear{SUFFIX[name]} needs {rule}") for name in ("2d", "2.5d") for args, rule in
                [((7, 4), "in_features divisible by q=2; got 7"), ((4, 7), "out_features divisible by q=2; got 7")]]
LINEAR_RULES += [("3d", (7, 4), "ParallelLinear3D needs in_features divisible by q=2; got 7"),
                 ("3d", (4, 6), "ParallelLinear3D needs out_features divisible by q*q=4; got 6")]


@pytest.mark.parametrize("name,args,rule", LINEAR_RULES)
def test_linear_divisibility_error(name, args, rule):
    for m in run_on_ranks(construction_error, world_of(name), name, "linear", args, {}):
        assert m is not None and rule in m


def test_linear_2p5d_rejects_a_2d_mesh():
    for m in run_on_ranks(construction_error, 4, "2d", "linear_2p5d", (4, 4), {}):
        assert m is not None and "ParallelLinear2p5D needs a ParallelMesh with tp_mode='2.5d'" in m


# -- LayerNorm, embeddings, classifier ------------------------------------------------------
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,examples", [("2d", 6), ("2d_dp2", 2), ("2.5d", 5), ("2.5d_d1", 5), ("3d", 5)])
def test_module_matches_serial(name, examples, kind):
    for_examples(examples, lambda draw: run_on_ranks(check_module, world_of(name), module_case(draw, name, kind)))


@pytest.mark.parametrize("kind,args", [("norm", (16,)), ("embedding", (10, 8)), ("vocab_embedding", (11, 6)),
                                       ("classifier", (8, 3)), ("lm_head", (6, 11, False))])
@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_default_init_equals_serial(name, kind, args):
    run_on_ranks(check_default_init, world_of(name), name, kind, args, 5)


def divisibility_rules(name):
    """(kind, args, rule) per module kind; 3D cuts H-indexed tables into q^3 pieces, not q^2."""
    s, chunks, bad = ("3D", "q*q*q=8", 12) if name == "3d" else (SUFFIX[name], "q*q=4", 6)
    return [("norm", (5,), f"LayerNorm{s} needs normalized_shape divisible by q=2; got 5"),
            ("embedding", (10, bad), f"Embedding{s} needs embedding_dim divisible by {chunks}; got {bad}"),
            ("vocab_embedding", (10, 5), f"VocabParallelEmbedding{s} needs embedding_dim divisible by q=2; got 5"),
            ("classifier", (bad, 3), f"Classifier{s} needs in_features divisible by {chunks}; got {bad}"),
            ("lm_head", (5, 10), f"LMHead{s} needs in_features divisible by q=2; got 5"),
            ("patch", (4, 2, 3, bad), f"PatchEmbedding{s} needs hidden_size divisible by {chunks}; got {bad}"),
            ("patch", (5, 2, 3, 8), f"PatchEmbedding{s} needs image_size divisible by patch_size=2; got 5")]


@pytest.mark.parametrize("name,kind,args,rule", [(n, *r) for n in ("2d", "2.5d", "3d") for r in divisibility_rules(n)])
def test_divisibility_errors(name, kind, args, rule):
    for m in run_on_ranks(construction_error, world_of(name), name, kind, args, {}):
        assert m is not None and rule in m and "Choose" in m  # value, rule and fix


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
        loss_p = placements.gather_batch(loss_p, mesh, head_p.output_placement).flatten()
    else:
        assert loss_p.dim() == 0
    w = randn(dseed + 1, loss.shape, loss.dtype)  # weights every per-token loss differently
    (loss * w).sum().backward()
    (loss_p * w).sum().backward()
    # logits over hidden, the loss over the vocabulary and the tokens, the table's gradient over the tokens
    terms = h + v + 2 * case["batch"] * case["seq"]
    tol = dict(terms=terms, condition=1.0 + float(logits.detach().abs().max()))
    loss_floor, emb_floor, head_floor = summand_sizes(emb, head, ids, target, w, reduction)
    assert_close(head_p.gather_output(logits_p.detach()), logits.detach(), "logits", terms=terms, parts=mesh.tp_size)
    assert_close(loss_p.detach(), loss.detach(), f"loss ({reduction})", parts=mesh.tp_size, floor=loss_floor, **tol)
    check_grads_match(emb_p, emb, mesh, "embedding", floor=emb_floor, **tol)
    if not case["tied"]:
        check_grads_match(head_p, head, mesh, "head", floor=head_floor, **tol)
    return float(loss_p.detach().sum())


def summand_sizes(emb, head, ids, target, w, reduction):
    """The root-mean-square size of the summands behind the loss and the table / head gradients
    (the ``floor`` of ``reorder_bound``): where the model is confident the loss lse - z_target
    and the logits' gradient p - onehot cancel to far less than their terms, and a rounding of a
    term (amplified by the softmax, which the ``condition`` covers) is a rounding of that size."""
    with torch.no_grad():
        keep = (target != -100).flatten()
        z = head(emb(ids)).double().flatten(0, 1)
        picked = z.gather(1, target.flatten().clamp(min=0)[:, None])[:, 0]
        per_token = (z.logsumexp(1).abs() + picked.abs()) * keep
        onehot = F.one_hot(target.flatten().clamp(min=0), z.shape[1]) * keep[:, None]
        weight = w.double().abs().reshape(-1, 1) / (keep.sum() if reduction == "mean" else 1)
        dz = (z.softmax(1) * keep[:, None] + onehot) * weight
        loss = per_token.sum() * weight.flatten()[0] if reduction != "none" else per_token
    # the same linear maps on the magnitudes: their gradients sum |terms| where the real ones sum terms
    table = emb.weight.detach().double().abs().requires_grad_()
    out = head.weight.detach().double().abs().requires_grad_() if head.weight is not emb.weight else table
    (table[ids.flatten()] @ out.T).backward(dz)
    if head.bias is not None:
        out_bias = dz.sum(0)
    grads = [table.grad] if out is table else [table.grad, out.grad]
    head_grads = [out.grad] + ([out_bias] if head.bias is not None else [])
    return rms_of([loss]), rms_of(grads[:1]), rms_of(head_grads)


def lm_case(draw, name, reduction="mean", q=2):
    return dict(name=name, reduction=reduction, vocab=draw(st.integers(2, 19)), hidden=q * draw(st.integers(1, 3)),
                batch=BATCH_PARTS[name] * draw(st.integers(1, 2)), seq=draw(st.integers(1, 3)),
                tied=draw(st.booleans()), bias=draw(st.booleans()), label_smoothing=draw(st.sampled_from([0.0, 0.1])),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)))


LM_CASES = [(name, r, n) for name, n in [("2d", 3), ("2.5d", 2), ("2.5d_d1", 2), ("3d", 2)] for r in ["mean", "sum", "none"]]


@pytest.mark.parametrize("name,reduction,examples", LM_CASES + [("2d_dp2", "mean|none", 2)])
def test_lm_head_with_cross_entropy(name, reduction, examples):
    """reduction "mean|none": each example draws one of the two."""
    def check(draw):
        r = draw(st.sampled_from(reduction.split("|"))) if "|" in reduction else reduction
        run_on_ranks(check_lm, world_of(name), lm_case(draw, name, r))

    for_examples(examples, check)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_lm_head_of_a_confident_tied_table(reduction):
    """A drawn example: a tied 3 x 4 table whose logits reach 14, so the loss lse - z_target and
    the logits' gradient p - onehot cancel to 1e-6 of their terms; the bound must come from the
    terms' size (summand_sizes) and the softmax's condition, not from the tiny results."""
    case = dict(name="2.5d", reduction=reduction, vocab=3, hidden=4, batch=BATCH_PARTS["2.5d"], seq=1, tied=True,
                bias=False, label_smoothing=0.0, dtype="fp32", seed=521)
    run_on_ranks(check_lm, world_of("2.5d"), case)


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


def patch_case(draw, name):
    patch = draw(st.integers(1, 3))
    return dict(name=name, image=patch * draw(st.integers(1, 3)), patch=patch, channels=draw(st.integers(1, 3)),
                hidden=hidden_parts_of(name) * draw(st.integers(1, 2)), batch=BATCH_PARTS[name] * draw(st.integers(1, 2)),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)), from_serial=draw(st.booleans()))


@pytest.mark.parametrize("name,examples", [("2d", 6), ("2.5d", 5), ("3d", 5)])
def test_patch_embedding_matches_vit(name, examples):
    for_examples(examples, lambda draw: run_on_ranks(check_patch, world_of(name), patch_case(draw, name)))


# -- classifier tied to an embedding's table ------------------------------------------------
def check_tied_classifier_grid(name, table, case):
    return check_tied_classifier(mesh_of(name), table, case)


def tied_case(draw, name, table, q=2):
    """A hidden-split table needs H divisible by its q*q (3D: q^3) pieces, a vocabulary-parallel
    one only by q; any number of classes (vocabulary padding)."""
    parts = q if table == "vocab_embedding" else hidden_parts_of(name)
    return dict(hidden=parts * draw(st.integers(1, 3)), classes=draw(st.integers(1, 9)),
                batch=BATCH_PARTS[name] * draw(st.integers(1, 2)), seq=draw(st.integers(1, 3)), bias=draw(st.booleans()),
                dtype=draw(st.sampled_from(list(DTYPES))), seed=draw(st.integers(0, 10**6)), factory=draw(st.booleans()))


@pytest.mark.parametrize("table", ["embedding", "vocab_embedding"])
@pytest.mark.parametrize("name,examples", [("2d", 3), ("2.5d", 3), ("3d", 3)])
def test_classifier_tied_to_a_table_matches_serial(name, examples, table):
    """Classifier{2D,2p5D,3D}(tie_to=Embedding / VocabParallelEmbedding of the mode): forward, dx
    and the shared table's gradient against nn.Embedding + nn.Linear sharing the table (2.5D at
    depth 2); the table saved once."""
    def check(draw):
        case = tied_case(draw, name, table)
        shapes = run_on_ranks(check_tied_classifier_grid, world_of(name), name, table, case)
        assert shapes[0] == (case["batch"], case["seq"], case["classes"])

    for_examples(examples, check)


def grid_tie_errors(name):
    mesh = mesh_of(name)
    kinds, h = classes(mesh.tp_mode), hidden_parts_of(name)
    emb = kinds["embedding"](10, h, mesh=mesh)
    who = f"Classifier{SUFFIX[name]}"
    with pytest.raises(ValueError, match=rf"{who}\(in_features={h}, num_classes=11\) cannot tie to .* with "
                                         r"embedding_dim=in_features, num_embeddings=num_classes"):
        kinds["classifier"](h, 11, mesh=mesh, tie_to=emb)
    with pytest.raises(ValueError, match="of the same mode, mesh and placement"):
        kinds["classifier"](h, 10, mesh=mesh, tie_to=nn.Embedding(10, h))
    if name == "3d":  # a table in another placement holds other hidden blocks
        with pytest.raises(ValueError, match="of the same mode, mesh and placement"):
            kinds["classifier"](h, 10, mesh=mesh, tie_to=emb, placement=placements.swapped_3d(emb.placement))
    return True


@pytest.mark.parametrize("name", ["2d", "3d"])
def test_classifier_tie_errors(name):
    run_on_ranks(grid_tie_errors, world_of(name), name)


def tied_checkpoint(name, table, case, ckpt_dir):
    return check_checkpoint_round_trip(mesh_of(name), table, case, ckpt_dir)


@pytest.mark.parametrize("name,table", [("2.5d", "vocab_embedding"), ("3d", "embedding")])
def test_tied_classifier_checkpoint_holds_the_table_once(name, table, tmp_path):
    case = dict(hidden=hidden_parts_of(name), classes=5, bias=True, dtype="fp32", seed=3, factory=True)
    run_on_ranks(tied_checkpoint, world_of(name), name, table, case, str(tmp_path / "ckpt"))
