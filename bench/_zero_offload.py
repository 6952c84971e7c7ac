"""The zero=3 + CPU offload step of bench/gpu_check.py: a tiny GPT-2 trained a few AdamW steps
under ``shardzoo.data_parallel(model, mesh, zero=3, offload=...)``, with and without offload, on
2 GPUs (dp=2); per rank: peak GPU memory, median step time, final loss (both must agree).

With fewer than 2 GPUs there is no dp group (data_parallel is a no-op there), so the step is
reported as skipped. ``python bench/_zero_offload.py --cpu`` runs the same step on 2 CPU ranks
(gloo) without offload, which checks everything but the offload itself.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root, when shardzoo is not installed

CONFIG = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=1024, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)


def zero3_steps(offload: bool, steps: int = 5, batch: int = 8, seq: int = 256) -> dict:
    """Per rank: {'peak_mib', 'step_ms', 'loss'} of ``steps`` zero=3 AdamW steps (dp = world)."""
    import shardzoo
    from shardzoo.models import GPT2, GPT2Config

    mesh = shardzoo.ParallelMesh(dp=torch.distributed.get_world_size())
    cuda = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
    model = GPT2(GPT2Config(**CONFIG), mesh=mesh, seed=0)
    model = shardzoo.data_parallel(model, mesh, zero=3, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq + 1), generator=gen).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    return {"peak_mib": peak, "step_ms": statistics.median(times[1:] or times), "loss": float(loss.detach())}


def _both(offload_options) -> list[dict]:
    return [{"offload": o, **zero3_steps(o)} for o in offload_options]


def run_zero3_offload() -> list[dict]:
    """Rank 0's rows for offload False / True on 2 GPUs; [] when fewer than 2 GPUs exist."""
    import shardzoo

    if torch.cuda.device_count() < 2:
        return []
    return shardzoo.launch(_both, 2, (False, True), timeout=900)[0]


if __name__ == "__main__" and "--cpu" in sys.argv:
    import shardzoo

    print(shardzoo.launch(_both, 2, (False,), backend="gloo", timeout=900)[0])
