"""Communication volume of every 2D / 2.5D / 3D layer against the closed forms of
docs/tp_modes.md (implemented in shardzoo/planner/volumes.py, which bench/tp_modes.py prints): the bytes ``shardzoo.comm.count`` records
for a forward + backward must equal the formula exactly. Also: 2.5D with depth 1 is 2D, bit for
bit and byte for byte."""

from fractions import Fraction

import pytest
import torch
from torch import nn

from shardzoo.layers import placements
from shardzoo.testing import dtypes, run_on_ranks
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.planner import volumes
from shardzoo.testing.grid import BATCH_PARTS, MLPBlock, classes, mesh_of, parallel_mlp, world_of
from shardzoo.testing.serial_twin import randn

DTYPES = dtypes("fp32", "fp64", "bf16")


# -- communication volume: counted bytes equal the closed forms of docs/tp_modes.md ---------
def mlp_block(mesh, hidden, ffn, seed):
    """(parallel MLP block, enter): the block bench/tp_modes.py measures, built by the factory."""
    torch.manual_seed(seed)
    serial = MLPBlock(nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden))
    return parallel_mlp(serial, mesh), layout_of(mesh).shard_input


def check_comm_volume(name, batch, seq, hidden, ffn, dtype_name):
    """Bytes this rank sends for the MLP block's forward + backward == docs formula."""
    from shardzoo import comm

    mesh = mesh_of(name)
    dtype = DTYPES[dtype_name]
    block, enter = mlp_block(mesh, hidden, ffn, 0)
    block.to(dtype)
    x = enter(randn(1, (batch, seq, hidden), dtype)).detach().requires_grad_(True)
    with comm.count() as counter:
        block(x).sum().backward()
    d = mesh.tp_depth
    expected = volumes.mlp_block_bytes(mesh.tp_mode, batch, seq, hidden, ffn, q=mesh.q, d=d, e=dtype.itemsize)
    assert counter.total_bytes == expected, f"{name}: counted {counter.total_bytes} != formula {expected}"
    return counter.total_bytes


@pytest.mark.parametrize("name", ["2d", "2d_dp2", "2.5d", "2.5d_d1", "3d"])
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_comm_volume_matches_docs_formula(name, dtype):
    hidden = 8 if name == "3d" else 6
    totals = run_on_ranks(check_comm_volume, world_of(name), name, BATCH_PARTS[name] * 2, 3, hidden, 16, dtype)
    assert len(set(totals)) == 1 and totals[0] > 0


def check_depth_one_is_2d(seed):
    """The same nn.Linear on a 2D mesh and a depth-1 2.5D mesh: identical results and traffic."""
    from shardzoo import comm

    out = []
    torch.manual_seed(seed)
    serial = nn.Linear(6, 4)
    x_full = randn(seed, (4, 3, 6), torch.float32)
    for name in ("2d", "2.5d_d1"):
        mesh = mesh_of(name)
        layer = classes(mesh.tp_mode)["linear"].from_serial(serial, mesh)
        x = x_full.clone().requires_grad_(True)
        with comm.count() as counter:
            y = layer.gather_output(layer(layer.shard_input(x)))
            y.square().sum().backward()
        out.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad,
                    [(r.kind, r.payload_bytes, r.group_size) for r in counter.records]))
    for a, b in zip(out[0], out[1]):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), "2.5D with depth 1 differs from 2D"
    return True


def test_2p5d_with_depth_one_behaves_as_2d():
    assert all(run_on_ranks(check_depth_one_is_2d, 4, 3))


def check_layer_volumes(name, vocab, hidden, classes_, batch, seq):
    """Counted bytes of each embedding / head layer's forward + backward == docs formula."""
    from shardzoo import comm

    mesh = mesh_of(name)
    kinds = classes(mesh.tp_mode)
    q, d, mode = mesh.q, mesh.tp_depth, mesh.tp_mode
    parts = placements.canonical_placement(mesh).batch_parts(mesh)
    rows = batch // parts * seq
    torch.manual_seed(0)
    ids = placements.shard_batch(torch.randint(0, vocab, (batch, seq)), mesh)
    x = placements.shard_activation(torch.randn(batch, seq, hidden), mesh).requires_grad_(True)
    cases = [
        ("embedding", kinds["embedding"](vocab, hidden, mesh=mesh), ids, volumes.embedding_bytes(mode, vocab, hidden, q, d)),
        ("vocab_embedding", kinds["vocab_embedding"](vocab, hidden, mesh=mesh), ids,
         volumes.vocab_embedding_bytes(mode, vocab, hidden, rows, q, d)),
        ("classifier", kinds["classifier"](hidden, classes_, mesh=mesh), x,
         volumes.classifier_bytes(mode, classes_, hidden, rows, q, d)),
        ("lm_head", kinds["lm_head"](hidden, vocab, True, mesh=mesh), x,
         volumes.lm_head_bytes(mode, vocab, hidden, rows, q, d, bias=True)),
        ("patch", kinds["patch"](4, 2, 3, hidden, mesh=mesh),
         placements.shard_batch(torch.randn(batch, 3, 4, 4), mesh),
         volumes.patch_embedding_bytes(mode, 4, 2, 3, hidden, q, d)),
    ]
    for kind, layer, inp, expected in cases:
        with comm.count() as counter:
            layer(inp).sum().backward()
        assert counter.total_bytes == expected, f"{name} {kind}: counted {counter.total_bytes} != formula {expected}"
    return True


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_layer_volumes_match_docs_formulas(name):
    assert all(run_on_ranks(check_layer_volumes, world_of(name), name, 13, 8, 3, BATCH_PARTS[name] * 2, 3))


# -- forward and backward bytes, parameter and saved-activation bytes per layer (docs/tp_modes.md) --
def ar(p, n):
    return Fraction(2 * (p - 1), p) * n


def ring(p, n):
    """all_gather / reduce_scatter of full size n (also one broadcast or reduce of n)."""
    return Fraction(p - 1, p) * n


def split_formulas(mode, q, d, batch, seq, vocab, hidden, classes_, image, patch, channels, e):
    """kind -> (forward bytes, backward bytes, parameter bytes, saved-activation bytes) as in
    docs/tp_modes.md (bias on everywhere, dropout off, inputs of float layers need a gradient)."""
    three = mode == "3d"
    g, p = (q * q, q * q) if three else (q, d * q)  # parameter-axes size G, batch parts P
    rows, e_s, e_id = batch // p * seq, max(e, 4), 8
    v_pad = -(-vocab // (q * q if three else q)) * (q * q if three else q)
    hq = hidden // q
    table = vocab * hq * e  # gathered [V, h/q] block of an Embedding table
    vb = v_pad // q * hq * e  # VocabParallelEmbedding: this rank's [V_pad/q, h/q] block (3D: after the gather)
    conv = hq * channels * patch * patch * e  # gathered conv weight block
    numel = hidden * channels * patch * patch + 2 * hidden + ((image // patch) ** 2 + 1) * hidden
    f = {
        "norm": (2 * ar(q, rows * e_s), ar(q, 2 * rows * e_s) + 2 * ar(p, hq * e), 2 * hq * e,
                 rows * (hq + 1) * e_s + (rows * hq * e if e < e_s else 0)),
        "embedding": (ring(g, table), ring(g, table) + ar(d, table // g), table // g, rows * e_id),
        "vocab_embedding": ((q - 1) * rows * (e_id + hq * e) + (ring(q, vb) if three else 0),
                            (q - 1) * rows * hq * e + (ring(q, vb) if three else ar(d, vb)),
                            vb // q if three else vb, q * rows * (e_id + 1)),
        "patch": (ring(g, numel // q * e), ring(g, numel // q * e) + ar(d, numel // (q * g) * e), numel // (q * g) * e,
                  batch // p * channels * image * image * e + conv),
        "classifier": (ring(g, classes_ * hq * e) + ar(q, rows * classes_ * e),
                       ring(g, classes_ * hq * e) + ar(d, classes_ * hq // g * e) + ar(p, classes_ * e),
                       (classes_ * hq // g + classes_) * e, (rows + classes_) * hq * e),
    }
    y = rows * v_pad // q * e  # logits block
    if three:  # the 3D linear product with n = V_pad, bias on
        x, w = rows * hq * e, v_pad * hq // (q * q) * e
        f["lm_head"] = ((q - 1) * (x + w + y), (q - 1) * (x + w + y) + ar(q * q, v_pad // q * e), w + v_pad // q * e,
                        q * (x + w))
    else:  # SUMMA nt forward, nn + tn backward, bias on
        w = v_pad * hq // q * e
        f["lm_head"] = ((q - 1) * (w + y), 2 * (q - 1) * (w + y) + ar(d, w) + ar(p, v_pad // q * e), w + v_pad // q * e,
                        rows * hq * e)
    stats = ar(q, rows * e_s) + ar(q, 3 * rows * e_s)  # max, then [sum_exp, target logit, sum of logits]
    saved = y + rows * (e_id + e_s) + e_id  # logits, flat targets, lse, the count of targets
    f["loss_mean"] = (stats + ar(p, e_s) + ar(p, e), 0, 0, saved + e_s)  # count (>= fp32) and the loss
    f["loss_sum"] = (stats + ar(p, e), 0, 0, saved)
    f["loss_none"] = (stats, 0, 0, saved)
    return f


def saved_bytes(fn, inp, params):
    """Bytes of the tensors autograd keeps for backward of ``fn(inp)`` (parameters excluded,
    storages counted once), and the output."""
    params = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(inp)
    return sum(seen.values()), out


def check_forward_backward_volumes(name, dtype_name):
    """Bytes counted in forward and in backward, parameter and saved bytes, each == the docs formula."""
    from shardzoo import comm

    mesh = mesh_of(name)
    kinds, dtype = classes(mesh.tp_mode), DTYPES[dtype_name]
    vocab, hidden, classes_, batch, seq = 13, 8, 3, BATCH_PARTS[name] * 2, 3
    f = split_formulas(mesh.tp_mode, mesh.q, mesh.tp_depth, batch, seq, vocab, hidden, classes_, 4, 2, 3, dtype.itemsize)
    torch.manual_seed(0)
    # clones: shard_batch may return a view of the full batch, whose storage would count as saved
    ids = placements.shard_batch(torch.randint(0, vocab, (batch, seq)), mesh).clone()
    x = placements.shard_activation(torch.randn(batch, seq, hidden, dtype=dtype), mesh).requires_grad_(True)
    pixels = placements.shard_batch(torch.randn(batch, 3, 4, 4, dtype=dtype), mesh).clone()
    head = kinds["lm_head"](hidden, vocab, True, mesh=mesh, dtype=dtype)
    layers = {"norm": (kinds["norm"](hidden, mesh=mesh, dtype=dtype), x),
              "embedding": (kinds["embedding"](vocab, hidden, mesh=mesh, dtype=dtype), ids),
              "vocab_embedding": (kinds["vocab_embedding"](vocab, hidden, mesh=mesh, dtype=dtype), ids),
              "patch": (kinds["patch"](4, 2, 3, hidden, mesh=mesh, dtype=dtype), pixels),
              "classifier": (kinds["classifier"](hidden, classes_, mesh=mesh, dtype=dtype), x),
              "lm_head": (head, x)}
    target = head.shard_target(torch.randint(0, vocab, (batch, seq)))
    logits = head(x).detach().requires_grad_(True)
    for r in ("mean", "sum", "none"):
        layers[f"loss_{r}"] = (lambda z, r=r: head.loss(z, target, reduction=r), logits)
    for kind, (layer, inp) in layers.items():
        params = list(getattr(layer, "parameters", list)())
        with comm.count() as fwd:
            saved, out = saved_bytes(layer, inp, params)
        with comm.count() as bwd:
            out.sum().backward()
        got = (fwd.total_bytes, bwd.total_bytes, sum(p.numel() * p.element_size() for p in params), saved)
        assert got == f[kind], f"{name} {dtype_name} {kind}: counted (fwd, bwd, params, saved) {got} != {f[kind]}"
    return True


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_backward_volumes_match_docs(name, dtype):
    """bf16 tells e (payload) from e_s (statistics kept in fp32) apart."""
    assert all(run_on_ranks(check_forward_backward_volumes, world_of(name), name, dtype))
