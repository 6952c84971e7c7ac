"""A classifier sharing an embedding's table, in any tp mode, against the serial tied pair.

The pair computes ``logits = head(emb(ids) + x)`` with ``head.weight`` the table itself, so the
table's gradient sums its use as a lookup and as the classifier's weight. On every rank the
parallel pair (table from the mode's factory, classifier tied to it) is compared with the
serial pair on full tensors: logits, dx, the shared table's gradient and the bias gradient,
each within the dtype's tolerance plus the serial result's own error against float64. The
checkpoint side is checked too: the table is one tensor with the classifier's name as its
alias, and ``full_state_dict`` equals the serial pair's state dict.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardzoo.checkpoint.tensors import model_tensors
from shardzoo.layers.embedding_1d import Embedding1D
from shardzoo.layers.full_state import full_state_dict
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import dtypes
from shardzoo.testing.serial_twin import data_seed, randn

DTYPES = dtypes("fp32", "fp64")


class TiedPair(nn.Module):
    """``head(emb(ids) + x)``: ids [B, S], x [B, S, H] -> logits [B, S, C] (``head`` may be
    tied to ``emb``'s table)."""

    def __init__(self, emb: nn.Module, head: nn.Module):
        super().__init__()
        self.emb, self.head = emb, head

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids) + x)


def serial_pair(hidden: int, classes: int, bias: bool, dtype: torch.dtype, seed: int) -> TiedPair:
    """nn.Embedding(classes, hidden) and nn.Linear(hidden, classes) drawn in that order from
    ``seed``, the linear's weight replaced by the table (a serial tied model)."""
    torch.manual_seed(seed)
    emb = nn.Embedding(classes, hidden, dtype=dtype)
    head = nn.Linear(hidden, classes, bias, dtype=dtype)
    head.weight = emb.weight
    return TiedPair(emb, head)


def parallel_table(mesh, table: str, emb: nn.Embedding) -> nn.Module:
    """The mode's ``table`` ("embedding", "vocab_embedding", or "Embedding1D": the 1D
    hidden-split table that no 1D factory builds) holding ``emb``'s values."""
    if table == "Embedding1D":
        return Embedding1D.from_serial(emb, mesh)
    return getattr(layout_of(mesh), table)(serial=emb)


def parallel_pair(mesh, table: str, serial: TiedPair, case: dict) -> TiedPair:
    """The parallel twin of ``serial``: built through the layout's factory from the serial
    classifier (``case["factory"]``), or by the classifier's constructor drawing its bias from
    ``case["seed"]`` as :func:`serial_pair` does."""
    layout = layout_of(mesh)
    emb = parallel_table(mesh, table, serial.emb)
    if case["factory"]:
        head = layout.classifier(serial=serial.head, tie_to=emb)
    else:
        torch.manual_seed(case["seed"])
        nn.Embedding(case["classes"], case["hidden"], dtype=DTYPES[case["dtype"]])  # the table's draw
        head = layout.kinds["classifier"](case["hidden"], case["classes"], case["bias"], mesh=mesh, tie_to=emb)
    assert head.weight is emb.weight, "the classifier holds a copy, not the table"
    return TiedPair(emb, head)


def check_tied_classifier(mesh, table: str, case: dict) -> tuple[int, ...]:
    """Compare the tied pair on ``mesh`` with the serial one (module docstring). case: hidden,
    classes, batch, seq, bias, dtype, seed, factory. Returns the logits' full shape."""
    dtype, seed = DTYPES[case["dtype"]], case["seed"]
    serial = serial_pair(case["hidden"], case["classes"], case["bias"], dtype, seed)
    par = parallel_pair(mesh, table, serial, case)
    layout = layout_of(mesh)
    check_saved_once(par, serial)

    dseed = data_seed(seed, mesh)
    ids = torch.randint(0, case["classes"], (case["batch"], case["seq"]), generator=torch.Generator().manual_seed(dseed))
    x = randn(dseed + 1, (case["batch"], case["seq"], case["hidden"]), dtype)
    xs, x64 = x.clone().requires_grad_(True), x.double().clone().requires_grad_(True)
    ys = serial(ids, xs)
    serial64 = copy.deepcopy(serial).double()  # the same serial math in float64 (the tie survives the copy)
    y64 = serial64(ids, x64)
    g = randn(dseed + 2, ys.shape, dtype)
    (ys * g).sum().backward()
    (y64 * g.double()).sum().backward()

    xp = x.clone().requires_grad_(True)
    y = par.head.gather_output(par(layout.shard_batch(ids), layout.shard_input(xp)))
    (y * g).sum().backward()
    # logits over hidden, dx over classes, the table's gradient over the tokens
    tol = dict(terms=case["hidden"] + case["classes"] + case["batch"] * case["seq"], parts=mesh.tp_size)
    assert_close_conditioned(y.detach(), ys.detach(), y64.detach(), "tied classifier logits", **tol)
    assert_close_conditioned(xp.grad, xs.grad, x64.grad, "tied classifier dx", **tol)
    table_grad = gather_full(par.emb.weight.grad, get_shard_spec(par.emb, "weight"), mesh)
    assert_close_conditioned(table_grad, serial.emb.weight.grad, serial64.emb.weight.grad, "shared table grad", **tol)
    if case["bias"]:
        bias_grad = gather_full(par.head.bias.grad, get_shard_spec(par.head, "bias"), mesh)
        assert_close_conditioned(bias_grad, serial.head.bias.grad, serial64.head.bias.grad, "bias grad", **tol)
    return tuple(y.shape)


def check_saved_once(par: TiedPair, serial: TiedPair) -> None:
    """The checkpoint lists the table once (the classifier's name is its alias) and the
    full-size state dict equals the serial tied pair's."""
    tensors, aliases = model_tensors(par)
    assert [t.name for t in tensors] == ["emb.weight"] + (["head.bias"] if serial.head.bias is not None else [])
    assert aliases == {"head.weight": "emb.weight"}, aliases
    state, ref = full_state_dict(par), serial.state_dict()
    assert state.keys() == ref.keys(), f"state keys {sorted(state)} != {sorted(ref)}"
    for k, v in ref.items():
        assert torch.equal(state[k], v), f"initial {k} differs from the serial tied pair's"


def check_checkpoint_round_trip(mesh, table: str, case: dict, ckpt_dir: str) -> bool:
    """Save the parallel tied pair: the index holds the table once, the classifier's weight as
    its alias. Loading it into a serial tied pair and into a parallel one, both drawn from
    another seed, gives back the saved values with the tie intact."""
    from shardzoo import checkpoint

    dtype, seed = DTYPES[case["dtype"]], case["seed"]
    serial = serial_pair(case["hidden"], case["classes"], case["bias"], dtype, seed)
    checkpoint.save(parallel_pair(mesh, table, serial, case), ckpt_dir)
    index = checkpoint.read_index(ckpt_dir)
    assert "head.weight" not in index["tensors"] and index["aliases"] == {"head.weight": "emb.weight"}, index
    other = dict(case, seed=seed + 1)
    fresh_serial = serial_pair(case["hidden"], case["classes"], case["bias"], dtype, seed + 1)
    fresh_par = parallel_pair(mesh, table, serial_pair(case["hidden"], case["classes"], case["bias"], dtype, seed + 1),
                              other)
    checkpoint.load(fresh_serial, ckpt_dir)
    checkpoint.load(fresh_par, ckpt_dir)
    assert fresh_serial.head.weight is fresh_serial.emb.weight and fresh_par.head.weight is fresh_par.emb.weight
    for what, state in [("serial", fresh_serial.state_dict()), ("parallel", full_state_dict(fresh_par))]:
        for k, v in serial.state_dict().items():
            assert torch.equal(state[k], v), f"{k} loaded into the {what} pair differs from the saved value"
    return True
