"""SelfAttention against a serial attention (nn.Linear projections + F.scaled_dot_product_attention)
in every tp_mode, with sp=2 (ring and Ulysses), causal and bidirectional with padding masks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.layers.attention import SelfAttention, fuse_qkv
from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of
from shardzoo.testing.meshes import with_world

# name -> (ParallelMesh kwargs, world)
LAYOUTS = {
    "serial": with_world(),
    "1d_tp2": with_world(tp=2),
    "1d_tp4": with_world(tp=4),
    "1d_tp2_sp2": with_world(tp=2, sp=2),
    "2d_tp4": with_world(tp=4, tp_mode="2d"),
    "2d_tp4_sp2": with_world(tp=4, tp_mode="2d", sp=2),
    "2.5d_tp8": with_world(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d_tp8": with_world(tp=8, tp_mode="3d"),
}


def serial_attention(lin, x, num_heads, causal, mask):
    """Reference: x [B, S, H] -> [B, S, H] with torch's SDPA; mask bool [B, S] (True = attend)."""
    b, s, h = x.shape
    q, k, v = (lin[n](x).view(b, s, num_heads, -1).transpose(1, 2) for n in ("q", "k", "v"))
    attn_mask = None
    if mask is not None:
        attn_mask = mask[:, None, None, :].expand(b, 1, s, s)
        if causal:
            attn_mask = attn_mask & torch.ones(s, s, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and mask is None)
    return lin["o"](out.transpose(1, 2).reshape(b, s, h))


def check_attention(layout, case):
    torch.manual_seed(case["seed"])
    mesh = cached_mesh(**LAYOUTS[layout][0])
    hidden, heads, batch, seq = case["hidden"], case["heads"], case["batch"], case["seq"]
    lin = {n: nn.Linear(hidden, hidden, bias=case["bias"]) for n in ("q", "k", "v", "o")}
    x = torch.randn(batch, seq, hidden)
    mask = None
    if case["padding"]:
        lengths = torch.randint(1, seq + 1, (batch,))
        lengths[0] = seq
        mask = torch.arange(seq)[None, :] < lengths[:, None]
    weight = torch.randn(batch, seq, hidden)
    common = dict(num_heads=heads, mesh=mesh, causal=case["causal"], sp_mode=case["sp_mode"], qkv_style=case["qkv"])
    if case.get("from_fused"):  # one [3H, H] linear with [q; k; v] rows, as GPT-2's c_attn transposed
        fused = nn.Linear(hidden, 3 * hidden, bias=case["bias"])
        with torch.no_grad():
            fused.weight.copy_(torch.cat([lin[n].weight for n in "qkv"]))
            if case["bias"]:
                fused.bias.copy_(torch.cat([lin[n].bias for n in "qkv"]))
        attn = SelfAttention.from_serial(qkv=fused, o=lin["o"], **common)
    else:
        attn = SelfAttention.from_serial(q=lin["q"], k=lin["k"], v=lin["v"], o=lin["o"], **common)
    x_ref = x.clone().requires_grad_()
    y_ref = serial_attention(lin, x_ref, heads, case["causal"], mask)
    x_par = x.clone().requires_grad_()
    local_mask = attn.shard_mask(mask) if mask is not None else None
    y = attn.gather_output(attn(attn.shard_input(x_par), local_mask))
    keep = mask[..., None] if mask is not None else torch.ones(1, dtype=torch.bool)  # padded rows: unspecified
    assert_close(y * keep, y_ref * keep, f"{layout} output", terms=TINY_MODEL_TERMS)
    ((y_ref * keep * weight).sum()).backward()
    ((y * keep * weight).sum()).backward()
    assert_close(x_par.grad, x_ref.grad, f"{layout} input grad", terms=TINY_MODEL_TERMS)
    if case["qkv"] == "fused":
        grads = {"qkv.weight": fuse_qkv(*(lin[n].weight.grad for n in "qkv"), heads)}
        if case["bias"]:
            grads["qkv.bias"] = fuse_qkv(*(lin[n].bias.grad for n in "qkv"), heads)
    else:
        grads = {f"{n}_proj.{p}": getattr(lin[n], p).grad for n in "qkv" for p in ("weight", "bias")
                 if getattr(lin[n], p) is not None}
    grads.update({f"out_proj.{p}": getattr(lin["o"], p).grad for p in ("weight", "bias") if getattr(lin["o"], p) is not None})
    floor = rms_of(grads.values())  # the key bias's gradient is zero: rounding noise of terms this size
    for name, p in attn.named_parameters():
        # each sp rank saw its own tokens: parameter gradients sum over sp, as over dp
        torch.distributed.all_reduce(p.grad, group=mesh.sp_group)
        assert_close(gather_full(p.grad, get_shard_spec(attn, name), mesh), grads[name], f"{layout} grad {name}",
                     terms=TINY_MODEL_TERMS, floor=floor)
    return tuple(y.shape)


BASE = dict(hidden=32, heads=4, batch=4, seq=8, bias=True, seed=0, causal=True, padding=False, sp_mode="ring",
            qkv="fused")
CASES = [
    ("serial", {}),
    ("1d_tp2", {"causal": False, "padding": True, "qkv": "separate"}),
    ("1d_tp4", {"from_fused": True}),
    ("1d_tp2_sp2", {}),
    ("1d_tp2_sp2", {"causal": False, "padding": True}),
    ("1d_tp2_sp2", {"sp_mode": "ulysses", "padding": True}),
    ("2d_tp4", {"causal": False, "padding": True}),
    ("2d_tp4_sp2", {}),
    ("2d_tp4_sp2", {"causal": False, "padding": True, "sp_mode": "ulysses", "heads": 8, "qkv": "separate"}),
    ("2.5d_tp8", {"padding": True, "bias": False}),
    ("3d_tp8", {"causal": False, "padding": True}),
    ("3d_tp8", {"qkv": "separate"}),
]


@pytest.mark.parametrize("layout,changes", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_self_attention_matches_serial(layout, changes):
    case = {**BASE, **changes}
    shapes = run_on_ranks(check_attention, LAYOUTS[layout][1], layout, case)
    assert shapes[0] == (case["batch"], case["seq"], case["hidden"])


def check_dropout(layout):
    """Dropout on the probabilities: reproducible from the seed, off in eval, and a real change
    in training."""
    from shardzoo.layers import random

    mesh = cached_mesh(**LAYOUTS[layout][0])
    torch.manual_seed(1)
    attn = SelfAttention(32, 4, mesh=mesh, causal=True, attn_dropout=0.5)
    x = attn.shard_input(torch.randn(4, 8, 32))
    runs = []
    for _ in range(2):
        random.manual_seed(mesh, 3)
        runs.append(attn(x).detach())
    assert torch.equal(runs[0], runs[1])
    attn.eval()
    plain = attn(x).detach()
    assert not torch.allclose(plain, runs[0])
    return True


@pytest.mark.parametrize("layout", ["serial", "1d_tp2_sp2"])
def test_attention_dropout_is_reproducible(layout):
    assert all(run_on_ranks(check_dropout, LAYOUTS[layout][1], layout))


def check_dropout_twin(layout, case):
    """In training with attention dropout, the tp x sp model equals its serial twin (the same
    module on a tp=1, sp=1 mesh) for the same torch seed: outputs, input and parameter grads."""
    world = LAYOUTS[layout][1]
    hidden, heads, batch, seq = 32, case.get("heads", 4), 4, 8
    torch.manual_seed(0)
    lin = {n: nn.Linear(hidden, hidden) for n in ("q", "k", "v", "o")}
    x, weight = torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)
    mask = torch.arange(seq)[None, :] < torch.tensor([seq, 3, 6, 1])[:, None]
    common = dict(num_heads=heads, causal=case["causal"], sp_mode=case["sp_mode"], attn_dropout=0.3)
    results = []
    for mesh in (cached_mesh(dp=world), cached_mesh(**LAYOUTS[layout][0])):  # serial twin, then parallel
        attn = SelfAttention.from_serial(q=lin["q"], k=lin["k"], v=lin["v"], o=lin["o"], mesh=mesh, **common)
        x_in = x.clone().requires_grad_()
        torch.manual_seed(5)  # the dropout seed comes from torch's default generator
        y = attn.gather_output(attn(attn.shard_input(x_in), attn.shard_mask(mask)))
        (y * mask[..., None] * weight).sum().backward()
        grads = {}
        for name, p in attn.named_parameters():
            torch.distributed.all_reduce(p.grad, group=mesh.sp_group)
            grads[name] = gather_full(p.grad, get_shard_spec(attn, name), mesh)
        results.append((y.detach() * mask[..., None], x_in.grad, grads))
    (y_ser, dx_ser, g_ser), (y_par, dx_par, g_par) = results
    assert_close(y_par, y_ser, f"{layout} output with dropout", terms=TINY_MODEL_TERMS)
    assert_close(dx_par, dx_ser, f"{layout} input grad with dropout", terms=TINY_MODEL_TERMS)
    floor = rms_of(g_ser.values())
    for name in g_ser:
        assert_close(g_par[name], g_ser[name], f"{layout} grad {name} with dropout", terms=TINY_MODEL_TERMS,
                     floor=floor)
    return True


@pytest.mark.parametrize("layout,case", [
    ("1d_tp2_sp2", dict(causal=True, sp_mode="ring")),
    ("2d_tp4_sp2", dict(causal=False, sp_mode="ulysses", heads=8)),
    ("3d_tp8", dict(causal=True, sp_mode="ring")),
])
def test_attention_dropout_matches_serial_twin(layout, case):
    assert all(run_on_ranks(check_dropout_twin, LAYOUTS[layout][1], layout, case))


def check_error(layout, kwargs):
    mesh = cached_mesh(**LAYOUTS[layout][0])
    try:
        SelfAttention(mesh=mesh, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def test_heads_not_divisible_by_tp():
    for m in run_on_ranks(check_error, 4, "1d_tp4", dict(hidden_size=48, num_heads=6)):
        assert m is not None and "num_heads divisible by tp=4; got num_heads=6" in m


def test_ulysses_heads_not_divisible_by_sp():
    for m in run_on_ranks(check_error, 4, "1d_tp2_sp2", dict(hidden_size=32, num_heads=2, sp_mode="ulysses")):
        assert m is not None and "divisible by sp=2" in m


def check_packed(layout, sp_mode):
    """Packed documents through SelfAttention: shard_input / forward / gather_output with the same
    cu_seqlens equal the serial attention run on each document alone."""
    torch.manual_seed(2)
    mesh = cached_mesh(**LAYOUTS[layout][0])
    hidden, heads, lengths = 16, 4, [1, 9, 4, 2]
    cu = torch.tensor([0, 1, 10, 14, 16], dtype=torch.int32)
    lin = {n: nn.Linear(hidden, hidden) for n in ("q", "k", "v", "o")}
    x, weight = torch.randn(1, sum(lengths), hidden), torch.randn(1, sum(lengths), hidden)
    attn = SelfAttention.from_serial(q=lin["q"], k=lin["k"], v=lin["v"], o=lin["o"], num_heads=heads, mesh=mesh,
                                     causal=True, sp_mode=sp_mode)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = torch.cat([serial_attention(lin, part, heads, True, None) for part in x_ref.split(lengths, 1)], 1)
    y = attn.gather_output(attn(attn.shard_input(x_par, cu_seqlens=cu), cu_seqlens=cu), cu_seqlens=cu)
    assert_close(y, y_ref, f"{layout} packed output", terms=TINY_MODEL_TERMS)
    (y_ref * weight).sum().backward()
    (y * weight).sum().backward()
    assert_close(x_par.grad, x_ref.grad, f"{layout} packed input grad", terms=TINY_MODEL_TERMS)
    return True


@pytest.mark.parametrize("layout,sp_mode", [("serial", "ring"), ("1d_tp2_sp2", "ring"), ("1d_tp2_sp2", "ulysses")])
def test_self_attention_takes_packed_documents(layout, sp_mode):
    assert all(run_on_ranks(check_packed, LAYOUTS[layout][1], layout, sp_mode))
