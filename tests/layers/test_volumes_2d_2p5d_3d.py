"""Communication volume of every 2D / 2.5D / 3D layer against the closed forms of
docs/tp_modes.md (implemented in bench/tp_modes.py): the bytes ``shardzoo.comm.count`` records
for a forward + backward must equal the formula exactly. Also: 2.5D with depth 1 is 2D, bit for
bit and byte for byte."""

import pytest
import torch
from torch import nn

from shardzoo.layers import layouts
from shardzoo.testing import run_on_ranks
from test_layouts import BATCH_PARTS, DTYPES, classes, mesh_of, randn, world_of


# -- communication volume: counted bytes equal the closed forms of docs/tp_modes.md ---------
def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "tp_modes.py"
    spec = importlib.util.spec_from_file_location("bench_tp_modes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_comm_volume(name, batch, seq, hidden, ffn, dtype_name):
    """Bytes this rank sends for the MLP block's forward + backward == docs formula."""
    from shardzoo import comm

    bench = _bench_module()
    mesh = mesh_of(name)
    dtype = DTYPES[dtype_name]
    block, enter, _ = bench.build(mesh, hidden, ffn, 0)
    block.to(dtype)
    x = enter(randn(1, (batch, seq, hidden), dtype)).detach().requires_grad_(True)
    with comm.count() as counter:
        block(x).sum().backward()
    d = mesh.tp_depth
    expected = bench.mlp_block_bytes(mesh.tp_mode, batch, seq, hidden, ffn, q=mesh.q, d=d, e=dtype.itemsize)
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

    bench = _bench_module()
    mesh = mesh_of(name)
    kinds = classes(mesh.tp_mode)
    q, d, mode = mesh.q, mesh.tp_depth, mesh.tp_mode
    parts = layouts.canonical_layout(mesh).batch_parts(mesh)
    rows = batch // parts * seq
    torch.manual_seed(0)
    ids = layouts.shard_batch(torch.randint(0, vocab, (batch, seq)), mesh)
    x = layouts.shard_activation(torch.randn(batch, seq, hidden), mesh).requires_grad_(True)
    cases = [
        ("embedding", kinds["embedding"](vocab, hidden, mesh=mesh), ids, bench.embedding_bytes(mode, vocab, hidden, q, d)),
        ("vocab_embedding", kinds["vocab_embedding"](vocab, hidden, mesh=mesh), ids,
         bench.vocab_embedding_bytes(mode, vocab, hidden, rows, q, d)),
        ("classifier", kinds["classifier"](hidden, classes_, mesh=mesh), x,
         bench.classifier_bytes(mode, classes_, hidden, rows, q, d)),
        ("lm_head", kinds["lm_head"](hidden, vocab, True, mesh=mesh), x,
         bench.lm_head_bytes(mode, vocab, hidden, rows, q, d, bias=True)),
        ("patch", kinds["patch"](4, 2, 3, hidden, mesh=mesh), layouts.shard_batch(torch.randn(batch, 3, 4, 4), mesh),
         bench.patch_embedding_bytes(mode, 4, 2, 3, hidden, q, d)),
    ]
    for kind, layer, inp, expected in cases:
        with comm.count() as counter:
            layer(inp).sum().backward()
        assert counter.total_bytes == expected, f"{name} {kind}: counted {counter.total_bytes} != formula {expected}"
    return True


@pytest.mark.parametrize("name", ["2d", "2.5d", "3d"])
def test_layer_volumes_match_docs_formulas(name):
    assert all(run_on_ranks(check_layer_volumes, world_of(name), name, 13, 8, 3, BATCH_PARTS[name] * 2, 3))
