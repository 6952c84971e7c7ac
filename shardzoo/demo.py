"""``shardzoo demo``: one transformer MLP block in every tensor-parallel layout, checked against serial.

On N local CPU ranks (4 by default), a serial block ``x + fc2(gelu(fc1(x)))`` is converted
layer by layer with ``from_serial`` into each layout that fits N ranks, run forward and
backward on the same batch, and compared with the serial block: output, input gradient and
every parameter gradient gathered to full size. The table also shows parameter bytes and
bytes sent per rank (``shardzoo.comm.count``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardzoo
from shardzoo import comm
from shardzoo.layers.shard_spec import gather_full, get_shard_spec

LAYOUTS_BY_WORLD = {
    1: [dict(tp=1)],
    2: [dict(tp=2, tp_mode="1d")],
    4: [dict(tp=4, tp_mode="1d"), dict(tp=4, tp_mode="2d"), dict(tp=4, tp_mode="2.5d", tp_depth=1)],
    8: [
        dict(tp=8, tp_mode="1d"),
        dict(dp=2, tp=4, tp_mode="2d"),
        dict(tp=8, tp_mode="2.5d", tp_depth=2),
        dict(tp=8, tp_mode="3d"),
    ],
}


def serial_block(hidden: int, seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({"fc1": nn.Linear(hidden, 4 * hidden), "fc2": nn.Linear(4 * hidden, hidden)})


def parallel_block(block: nn.ModuleDict, mesh) -> nn.ModuleDict:
    """The same block in the mesh's tp layout, weights sliced from the serial one."""
    from shardzoo.layers.linear_1d import ParallelLinear1D
    from shardzoo.layers.linear_2d import ParallelLinear2D
    from shardzoo.layers.linear_2p5d import ParallelLinear2p5D
    from shardzoo.layers.linear_3d import ParallelLinear3D

    if mesh.tp_mode == "1d":
        fc1 = ParallelLinear1D.from_serial(block["fc1"], mesh, style="column")
        fc2 = ParallelLinear1D.from_serial(block["fc2"], mesh, style="row")
    elif mesh.tp_mode == "3d":
        fc1 = ParallelLinear3D.from_serial(block["fc1"], mesh)
        fc2 = ParallelLinear3D.from_serial(block["fc2"], mesh, input_layout=fc1.output_layout)
    else:
        cls = ParallelLinear2D if mesh.tp_mode == "2d" else ParallelLinear2p5D
        fc1, fc2 = cls.from_serial(block["fc1"], mesh), cls.from_serial(block["fc2"], mesh)
    return nn.ModuleDict({"fc1": fc1, "fc2": fc2})


def _describe(mesh) -> str:
    grid = "x".join(str(mesh.size(a)) for a in mesh.tp_sub_axes)
    extra = "".join(f" {a}={mesh.size(a)}" for a in ("dp", "pp", "sp") if mesh.size(a) > 1)
    return f"{mesh.tp_mode} tp={mesh.tp_size} [{grid}]{extra}"


def _forward(block: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    return x + block["fc2"](F.gelu(block["fc1"](x)))


def _max_grad_diff(parallel: nn.ModuleDict, serial: nn.ModuleDict, mesh) -> float:
    serial_params = dict(serial.named_parameters())
    worst = 0.0
    for name, p in parallel.named_parameters():
        full = gather_full(p.grad, get_shard_spec(p), mesh)
        worst = max(worst, (full - serial_params[name].grad).abs().max().item())
    return worst


def run_layout(layout: dict, hidden: int, batch: int, seq: int, seed: int) -> dict:
    """Runs on every rank: one layout's comparison; returns rank-local figures."""
    mesh = shardzoo.ParallelMesh(**layout)
    serial = serial_block(hidden, seed)
    parallel = parallel_block(serial, mesh)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed + 1))
    target = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed + 2))

    x_serial = x.clone().requires_grad_(True)
    F.mse_loss(_forward(serial, x_serial), target).backward()

    x_full = x.clone().requires_grad_(True)
    with comm.count() as counter:
        y = mesh.gather_output(_forward(parallel, mesh.shard_input(x_full)))
        F.mse_loss(y, target).backward()
    with torch.no_grad():
        y_serial = _forward(serial, x)
    return {
        "layout": _describe(mesh),
        "out_diff": (y - y_serial).abs().max().item(),
        "input_grad_diff": (x_full.grad - x_serial.grad).abs().max().item(),
        "param_grad_diff": _max_grad_diff(parallel, serial, mesh),
        "param_bytes": sum(p.numel() * p.element_size() for p in parallel.parameters()),
        "serial_param_bytes": sum(p.numel() * p.element_size() for p in serial.parameters()),
        "sent_bytes": int(counter.total_bytes),
    }


def _demo_on_ranks(layouts: list[dict], hidden: int, batch: int, seq: int, seed: int) -> list[dict]:
    return [run_layout(layout, hidden, batch, seq, seed) for layout in layouts]


def run_demo(ranks: int = 4, hidden: int = 64, batch: int = 8, seq: int = 16, seed: int = 0) -> list[dict]:
    """Run the demo on ``ranks`` local processes and print the table; returns rank 0's rows."""
    if ranks not in LAYOUTS_BY_WORLD:
        raise ValueError(f"--ranks {ranks} is not supported; use one of {sorted(LAYOUTS_BY_WORLD)}")
    layouts = LAYOUTS_BY_WORLD[ranks]
    print(f"MLP block h={hidden} (ffn {4 * hidden}), batch {batch} x seq {seq}, fp32, {ranks} CPU ranks (gloo)")
    per_rank = shardzoo.launch(_demo_on_ranks, ranks, layouts, hidden, batch, seq, seed)
    rows = per_rank[0]
    header = f"{'layout':<26} {'max|dy|':>9} {'max|dx|':>9} {'max|dW|':>9} {'params/rank':>12} {'sent/rank':>11}"
    print(header)
    print("-" * len(header))
    for i, row in enumerate(rows):
        worst = {k: max(r[i][k] for r in per_rank) for k in ("out_diff", "input_grad_diff", "param_grad_diff")}
        share = row["param_bytes"] / row["serial_param_bytes"]
        print(
            f"{row['layout']:<26} {worst['out_diff']:9.1e} {worst['input_grad_diff']:9.1e} "
            f"{worst['param_grad_diff']:9.1e} {share:11.1%} {row['sent_bytes'] / 2**10:8.1f} KiB"
        )
    print("max|..| = largest difference from the serial block over all ranks (output, input grad, param grads)")
    return rows
