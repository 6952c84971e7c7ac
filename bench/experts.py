"""Mixture of experts: one training step (forward, backward, AdamW step) of a Mixtral-like
``MixtralForCausalLM`` split by ``shardzoo.parallelize`` over an ep axis vs the same model split
by transformers' own expert parallelism, on the same ranks.

Per layout (world W, ep E; default W = E = 2 and W = E = 4; one launch each, every
implementation in it, interleaved step by step):

* shardzoo: ``MixtralForCausalLM.from_pretrained(dir)``, then ``shardzoo.parallelize(model,
  ParallelMesh(dp=W, ep=E))`` (the model's own ep plan: experts split E ways, dropless
  all-to-all dispatch, one grouped matmul per projection) and ``shardzoo.data_parallel(model,
  mesh, zero=Z)``, AdamW from ``shardzoo.zero_optimizer``. Default ZeRO 3, as transformers
  shards the dense parameters with FSDP2 over its fsdp axis; ``--zero 0`` runs DDP instead.
* transformers: ``MixtralForCausalLM.from_pretrained(dir, distributed_config=
  DistributedConfig(fsdp_size=W, ep_size=E, ep_implementation="all_to_all"))`` (its
  ``base_model_ep_plan``: experts split over ep, the routed tokens exchanged by all-to-all;
  FSDP2 over fsdp for the rest, over W / E for the experts), ``torch.optim.AdamW``; its experts
  run with its default ``experts_implementation`` (``grouped_mm``).
* control: shardzoo a second time (its own model and optimizer), whose ratio to shardzoo is
  this host's noise (the A/A row).

All start from the same weights (random, seeded, saved once with transformers to a scratch
directory; routers drawn wide, std 1, so that no token's top-2 is a near tie that the two
implementations' rounding could flip) and see the same [B, S] token batch every step, each rank
its B / W rows (labels = input ids, all-ones attention mask), fp32, sdpa attention, no aux loss.
The loss printed is the mean over ranks of each rank's loss (the rows of a rank hold the same
number of tokens, so it is the whole batch's loss). A step is timed between two barriers (the
slowest rank's time); the ratio is the median over steps of the paired ratio (every
implementation runs once per round, in rotating order).

Also per rank:

* bytes shardzoo's dispatch sent in the last step, as ``shardzoo.comm.count`` records them
  (``all_to_all``: the counts per expert; ``all_to_all_v``: the rows), against the formula of
  docs/parallelize.md, per MoE layer ``8 E (ep-1)/ep + 2 H itemsize (s + r)`` with ``s`` the
  pairs of this rank's tokens routed to another rank's experts and ``r`` the pairs the other
  ranks route to its experts, read from the step's routing;
* peak memory: the bytes of live tensors at the peak of one more (untimed) step, torch's
  ``MemTracker`` (parameters, gradients, optimizer state, activations and temporaries of this
  implementation only, whatever else the process holds), split into parameters + gradients +
  optimizer state and the rest.

    python bench/experts.py                 # hidden 512, 8 experts top 2, 2 layers, 8 x 512 tokens, ep 2 and 4
    python bench/experts.py --quick         # smoke sizes; prints the table, writes nothing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import warnings
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import build_all, first_line, interleaved_steps  # noqa: E402
from _results import markdown_table, write_results  # noqa: E402

import shardzoo  # noqa: E402

SHARDZOO = "shardzoo.parallelize ep"
HF_EP = "transformers ep all_to_all"
CONTROL = "shardzoo.parallelize ep again (control)"
NAMES = [SHARDZOO, HF_EP, CONTROL]
# the ratio of each row: (numerator, denominator)
RATIO_OF = {SHARDZOO: (SHARDZOO, HF_EP), HF_EP: (HF_EP, HF_EP), CONTROL: (CONTROL, SHARDZOO)}
SHORT = {SHARDZOO: "shardzoo", HF_EP: "transformers", CONTROL: "control"}
QUICK = dict(hidden=64, intermediate=64, heads=4, kv_heads=2, vocab=256, seq=64, steps=1)


def mixtral_config(cfg: dict):
    import transformers

    return transformers.MixtralConfig(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
        num_local_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"], max_position_embeddings=cfg["seq"],
        output_router_logits=False, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
        pad_token_id=None)


def write_model(root: str, cfg: dict) -> str:
    """Save the seeded Mixtral with transformers (routers std 1: clear top-k margins)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(mixtral_config(cfg)).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    path = os.path.join(root, "mixtral")
    model.save_pretrained(path)
    return path


class Impl:
    """A model, its optimizer and the routing of its last step (shardzoo: per MoE layer, the
    expert counts of this rank's pairs, for the bytes formula)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.counts: list[torch.Tensor] = []
        self.itemsize = 0  # of the experts' rows (shardzoo)

    def step(self, ids, mask) -> float:
        self.counts.clear()
        loss = self.model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _build(name: str, path: str, mesh, cfg: dict) -> Impl:
    import transformers

    world, ep = dist.get_world_size(), mesh.ep_size
    if name == HF_EP:
        from transformers import DistributedConfig

        config = DistributedConfig(fsdp_size=world, ep_size=ep, ep_implementation="all_to_all")
        model = transformers.MixtralForCausalLM.from_pretrained(path, distributed_config=config).train()
        return Impl(model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"]))
    model = transformers.MixtralForCausalLM.from_pretrained(path)
    shardzoo.parallelize(model, mesh)
    from shardzoo.layers.experts import ExpertsEP

    impl = Impl(None, None)
    for module in model.modules():
        if isinstance(module, ExpertsEP):  # the routing of each step, for the bytes formula
            impl.itemsize = module.gate_up_proj.element_size()
            module.register_forward_pre_hook(
                lambda m, args: impl.counts.append(torch.bincount(args[1].reshape(-1), minlength=m.n_experts)))
    wrapped = shardzoo.data_parallel(model, mesh, zero=cfg["zero"])  # the model itself, wrapped in place
    impl.model, impl.opt = wrapped.train(), shardzoo.zero_optimizer(wrapped, torch.optim.AdamW, lr=cfg["lr"])
    return impl


def dispatch_formula(counts: list[torch.Tensor], mesh, hidden: int, itemsize: int) -> Fraction:
    """docs/parallelize.md's bytes for this rank's dispatch over one step: per MoE layer
    ``8 E (ep-1)/ep + 2 H itemsize (s + r)``, ``counts`` [layers] x [E] pairs per expert of
    each rank's tokens (this rank's own, gathered from all)."""
    ep, me = mesh.ep_size, mesh.ep_rank
    mine = torch.stack(counts)  # [layers, E]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    group = mesh.ranks("ep")  # global ranks of this ep group, by ep rank
    n_experts = mine.shape[1]
    n_local = n_experts // ep
    ours = slice(me * n_local, (me + 1) * n_local)
    total = Fraction(0)
    for layer in range(mine.shape[0]):
        sent = int(mine[layer].sum() - mine[layer, ours].sum())
        arrived = sum(int(every[r][layer, ours].sum()) for i, r in enumerate(group) if i != me)
        total += Fraction(8 * n_experts * (ep - 1), ep) + 2 * hidden * itemsize * (sent + arrived)
    return total


def tracked_peak(impl: Impl, ids, mask) -> dict:
    """Bytes of this implementation's live tensors at the peak of one step (torch's MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(impl.model, impl.opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        with tracker:
            impl.step(ids, mask)
    [peak] = tracker.get_tracker_snapshot("peak").values()
    kinds = {k.name: int(v) for k, v in peak.items() if k != "Total"}
    state = sum(kinds.get(k, 0) for k in ("PARAM", "GRAD", "OPT"))
    return {"total": int(peak["Total"]), "state": state, "rest": int(peak["Total"]) - state}


def _mean_over_ranks(values: list[float]) -> list[float]:
    """Each of ``values`` (one per step, as many on every rank) averaged over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def run(cfg: dict, path: str, ep: int) -> list[dict]:
    """On every rank: build the implementations, time them interleaved, count, track memory."""
    from transformers.utils import logging

    from shardzoo import comm

    logging.disable_progress_bar()

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = shardzoo.ParallelMesh(dp=world, ep=ep)
    impls, errors = build_all(NAMES, lambda name: _build(name, path, mesh, cfg))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen).chunk(world)[rank]
    mask = torch.ones_like(ids)
    counted = {}

    def step(name: str) -> float:
        with comm.count() as counter:
            loss = impls[name].step(ids, mask)
        counted[name] = counter.bytes
        return loss

    times, losses = interleaved_steps(impls, NAMES, errors, cfg["warmup"], cfg["steps"], step, f"world {world} ep {ep}")
    losses = {name: _mean_over_ranks(values) for name, values in losses.items()}  # rank 0 printed its own
    rows = []
    for name in NAMES:
        row = {"world": world, "ep": ep, "impl": name, "losses": losses[name], "error": errors.get(name),
               "steps_s": times[name]}
        if name in impls:
            impl = impls[name]
            if impl.counts:  # shardzoo: the last step's dispatch bytes, counted and by the formula
                got = counted[name]
                dispatch = got.get("all_to_all", Fraction(0)) + got.get("all_to_all_v", Fraction(0))
                formula = dispatch_formula(impl.counts, mesh, cfg["hidden"], impl.itemsize)
                row["dispatch_bytes"] = _gather([float(dispatch), float(formula), float(sum(got.values()))])
            try:
                peak = tracked_peak(impl, ids, mask)
            except Exception as e:  # noqa: BLE001  (the step then shows no memory)
                peak = {"error": first_line(e)}
            row["peak"] = _gather_objects(peak)
        rows.append(row)
    return rows


def _gather(values: list[float]) -> list[list[float]]:
    """[rank][i] of every rank's ``values``."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def table(data: list[dict]) -> str:
    def find(r, impl):
        return next(d for d in data if (d["world"], d["ep"], d["impl"]) == (r["world"], r["ep"], impl))

    rows = []
    for r in data:
        num, den = (find(r, n) for n in RATIO_OF[r["impl"]])
        n = min(len(num["steps_s"]), len(den["steps_s"]))
        ratio = statistics.median(a / b for a, b in zip(num["steps_s"][:n], den["steps_s"][:n])) if n else None
        hf = find(r, HF_EP)
        m = min(len(r["losses"]), len(hf["losses"]))
        r["ratio"] = ratio
        r["loss0_diff"] = r["losses"][0] - hf["losses"][0] if m else None
        r["loss_last_diff"] = r["losses"][m - 1] - hf["losses"][m - 1] if m else None
        peaks = [p for p in r.get("peak", []) if "total" in p]
        mib = lambda key: "/".join(f"{p[key] / 2**20:.1f}" for p in peaks) or "-"  # noqa: E731
        if r.get("dispatch_bytes"):
            counted = "/".join(f"{c / 2**20:.2f}" for c, _, _ in r["dispatch_bytes"])
            same = all(c == f for c, f, _ in r["dispatch_bytes"])
            dispatch = f"{counted} ({'= formula' if same else 'formula ' + '/'.join(f'{f / 2**20:.2f}' for _, f, _ in r['dispatch_bytes'])})"
        else:
            dispatch = "-"
        timed = bool(r["steps_s"])
        rows.append([f"{r['world']} / {r['ep']}", r["impl"],
                     f"{statistics.median(r['steps_s']):.2f}" if timed else "-",
                     f"{ratio:.3f} ({' / '.join(SHORT[s] for s in RATIO_OF[r['impl']])})"
                     if ratio is not None else "-",
                     f"{r['losses'][0]:.6f}" if r["losses"] else "-",
                     f"{r['loss0_diff']:+.1e}" if r["loss0_diff"] is not None else "-",
                     f"{r['loss_last_diff']:+.1e}" if r["loss_last_diff"] is not None else "-",
                     dispatch, mib("total"), mib("state"),
                     f"crashed: `{r['error']}`" if r["error"] else ""])
    headers = ["world / ep", "impl", "median step s", "time ratio (paired)", "loss, step 0",
               "loss - transformers', step 0", "same, last step", "dispatch MiB sent per rank (counted)",
               "peak MiB per rank", "of which params + grads + optimizer", "error"]
    return markdown_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layouts", nargs="+", default=["2/2", "4/4"], help="world/ep pairs, ep dividing world")
    ap.add_argument("--zero", type=int, default=3, choices=(0, 2, 3), help="shardzoo's data_parallel ZeRO stage")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--quick", action="store_true", help="smoke sizes (" + ", ".join(
        f"{k} {v}" for k, v in QUICK.items()) + "; options given beside it win); prints the table, writes no results")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    args = ap.parse_args()
    if args.quick:  # the smoke sizes as defaults: options given on the command line still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    layouts = [tuple(int(x) for x in s.split("/")) for s in args.layouts]
    for world, ep in layouts:
        if world % ep or args.experts % ep or args.batch % world:
            raise SystemExit(f"layout {world}/{ep}: ep must divide the world ({world}) and the experts "
                             f"({args.experts}), and the world the batch ({args.batch}); pick another --layouts")
    # ranks start with the allocator pinned (buffers up to 32 MiB from the heap, kept there), so no
    # implementation pays page faults for its activations that another happens to avoid
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
    cfg = vars(args)
    data = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        path = write_model(root, cfg)
        for world, ep in layouts:
            data += shardzoo.launch(run, world, cfg, path, ep, timeout=3600)[0]  # every rank returns the same rows
    text = table(data)
    print(text)
    if args.quick:
        return
    controls = ", ".join(f"{r['ratio']:.3f}" for r in data if r["impl"] == CONTROL and r.get("ratio"))
    note = (f"Mixtral: hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts top {args.top_k}, "
            f"{args.layers} layers, {args.heads} heads, {args.kv_heads} kv heads, vocabulary {args.vocab}; batch "
            f"{args.batch} x {args.seq} tokens over the world, fp32, gloo, AdamW(lr={args.lr}), shardzoo at ZeRO "
            f"{args.zero}; {args.steps} timed steps after {args.warmup} warm-up. Step times are the slowest rank's. "
            "Time ratio: the median over steps of the paired ratio, shardzoo / transformers, and the control / "
            f"shardzoo (A/A: this host's resolution, {controls or 'n/a'}). Losses: the mean over ranks; all start "
            "from the same weights and batch (step 0), each runs its own AdamW (last step). Dispatch: the bytes "
            "each rank's experts layers sent in the last step (counts and rows, forward and backward; rank 0 / "
            "rank 1 / ...), checked against docs/parallelize.md's formula from that step's routing. Peak: live "
            "tensors of the implementation at the peak of one more step (torch's MemTracker), per rank.")
    write_results("experts", "Mixture of experts: shardzoo ep vs transformers' expert parallelism (bench/experts.py)",
                  text, {"config": cfg, "rows": data}, note)


if __name__ == "__main__":
    main()
