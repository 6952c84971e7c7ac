"""``shardzoo.parallelize`` on transformers models: one training step (forward, backward, AdamW
step) of a ``LlamaForCausalLM`` split by shardzoo vs the same model split by transformers' own
tensor parallelism, and shardzoo's native ``GPT2`` vs ``parallelize(GPT2LMHeadModel)``.

Per world size (one launch each, every implementation in it, interleaved step by step):

* Llama (hidden 1024, 8 heads, 2 kv heads, 4 layers; default intermediate_size 1024 and
  vocabulary 4096, chosen so that one step of the 8 x 512-token batch takes seconds, not
  minutes, on a 2-core host), 1D tp = world:

  * shardzoo: ``LlamaForCausalLM.from_pretrained(dir)`` then ``shardzoo.parallelize(model,
    ParallelMesh(tp=p))`` (the model's own ``tp_plan``; with tp > kv heads the kv heads are
    repeated, docs/parallelize.md).
  * transformers: ``LlamaForCausalLM.from_pretrained(dir, distributed_config=
    DistributedConfig(tp_plan="auto"))``, on the same gloo world (the ranks are started with
    torchrun's environment and the default process group already made, which transformers
    uses on a CPU-only host). A load or step that raises is recorded with its message's first
    line and the implementation dropped from the launch (at tp=4 transformers cannot split 2 kv
    heads).
  * control: shardzoo a second time (its own model and optimizer), whose ratio to shardzoo is
    this host's noise.

* GPT-2 of the same size class (4 layers, n_embd 1024, 8 heads, n_inner and vocabulary as the
  Llama's, 512 positions, no dropout), at tp=2 only: shardzoo's native ``shardzoo.models.GPT2``
  (``GPT2.from_pretrained``) vs ``shardzoo.parallelize(GPT2LMHeadModel.from_pretrained(dir))``,
  with the native model run a second time as the control.

All models of a group start from the same weights (random, seeded, saved once with
transformers to a scratch directory) and see the same full [B, S] token batch every step
(labels = input ids, all-ones attention mask for the Llama, none for GPT-2), fp32; the
transformers models use ``attn_implementation="sdpa"``, the native GPT-2 its own attention,
which on CPU calls the same fused kernel of torch. A step is ``loss = model(...).loss; loss.backward(); AdamW.step();
zero_grad()`` (native GPT-2: ``model.loss(model(model.shard_input(ids)), labels=ids)``), timed
between two barriers, so it is the slowest rank's time. The ratio column is the median over
steps of the paired ratio (this implementation's step / the reference's step in the same
round; rounds run every implementation back to back in rotating order). Losses are those of
the first (untimed, identical weights) step and of the last step; each implementation runs its
own optimizer, so correct implementations agree at every step up to rounding.

    python bench/parallelize.py                                   # Llama tp 2 and 4, GPT-2 tp 2
    python bench/parallelize.py --hidden 256 --seq 128 --steps 2  # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import build_all, interleaved_steps  # noqa: E402
from _results import markdown_table, write_results  # noqa: E402

import shardzoo  # noqa: E402

SHARDZOO = "shardzoo.parallelize"
HF_TP = "transformers tp_plan=auto"
CONTROL = "shardzoo.parallelize again (control)"
NATIVE = "shardzoo GPT2 (native)"
GPT2_PAR = "shardzoo.parallelize(GPT2LMHeadModel)"
NATIVE_CONTROL = "shardzoo GPT2 again (control)"


def write_models(root: str, cfg: dict) -> dict:
    """Save the seeded Llama and GPT-2 with transformers; returns their directories."""
    import transformers

    dirs = {"llama": os.path.join(root, "llama"), "gpt2": os.path.join(root, "gpt2")}
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg))).save_pretrained(dirs["llama"])
    if cfg["gpt2"]:
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config(cfg))).save_pretrained(dirs["gpt2"])
    return dirs


def llama_config(cfg: dict) -> dict:
    return dict(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
                num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
                max_position_embeddings=cfg["seq"], attn_implementation="sdpa")


def gpt2_config(cfg: dict) -> dict:
    return dict(n_embd=cfg["hidden"], n_layer=cfg["layers"], n_head=cfg["heads"], n_inner=cfg["intermediate"],
                vocab_size=cfg["vocab"], n_positions=cfg["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")


class Impl:
    """A model, its optimizer and how one step runs."""

    def __init__(self, model, step, lr):
        self.model, self.run_step = model, step
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self, batch) -> float:
        loss = self.run_step(self.model, batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _hf_step(model, batch):
    ids, mask = batch
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _native_step(model, batch):
    ids, _ = batch
    return model.loss(model(model.shard_input(ids)), labels=ids)


def _build(name: str, dirs: dict, mesh, lr: float) -> Impl:
    import transformers

    if name in (SHARDZOO, CONTROL):
        return Impl(shardzoo.parallelize(transformers.LlamaForCausalLM.from_pretrained(dirs["llama"]), mesh),
                    _hf_step, lr)
    if name == HF_TP:
        from transformers import DistributedConfig

        model = transformers.LlamaForCausalLM.from_pretrained(dirs["llama"],
                                                              distributed_config=DistributedConfig(tp_plan="auto"))
        return Impl(model.train(), _hf_step, lr)
    if name in (NATIVE, NATIVE_CONTROL):
        from shardzoo.models import GPT2

        return Impl(GPT2.from_pretrained(dirs["gpt2"], mesh=mesh).train(), _native_step, lr)
    if name == GPT2_PAR:
        return Impl(shardzoo.parallelize(transformers.GPT2LMHeadModel.from_pretrained(dirs["gpt2"]), mesh),
                    _hf_step, lr)
    raise ValueError(name)


def run_group(group: str, names: list[str], dirs: dict, mesh, cfg: dict) -> list[dict]:
    """Build ``names`` (a failing build is recorded), then time them interleaved."""
    p = dist.get_world_size()
    impls, errors = build_all(names, lambda name: _build(name, dirs, mesh, cfg["lr"]))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    batch = (ids, torch.ones_like(ids)) if group == "llama" else (ids, None)
    times, losses = interleaved_steps(impls, names, errors, cfg["warmup"], cfg["steps"],
                                      lambda name: impls[name].step(batch), f"{group} tp={p}")
    return [{"model": group, "world": p, "impl": name, "steps_s": times[name], "losses": losses[name],
             "error": errors.get(name)} for name in names]


def run(cfg: dict, dirs: dict) -> list[dict]:
    p = dist.get_world_size()
    mesh = shardzoo.ParallelMesh(tp=p)
    rows = run_group("llama", [SHARDZOO, HF_TP, CONTROL], dirs, mesh, cfg)
    if cfg["gpt2"] and p == 2:
        rows += run_group("gpt2", [NATIVE, GPT2_PAR, NATIVE_CONTROL], dirs, mesh, cfg)
    return rows


REFERENCE = {"llama": SHARDZOO, "gpt2": NATIVE}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--no-gpt2", dest="gpt2", action="store_false", help="skip the GPT-2 group (run at tp=2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    args = ap.parse_args()
    # Ranks start with the allocator pinned (buffers up to 32 MiB from the heap, kept there), so no
    # implementation pays page faults for its activations that another happens to avoid.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
    cfg = vars(args)
    data = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        dirs = write_models(root, cfg)
        for world in args.worlds:
            data += shardzoo.launch(run, world, cfg, dirs, timeout=3600)[0]  # every rank returns the same rows

    def ref_of(r):
        return next(d for d in data if (d["model"], d["world"], d["impl"]) == (r["model"], r["world"], REFERENCE[r["model"]]))

    rows = []
    for r in data:
        ref = ref_of(r)
        n = min(len(r["steps_s"]), len(ref["steps_s"]))
        r["vs_ref"] = statistics.median(a / b for a, b in zip(r["steps_s"][:n], ref["steps_s"][:n])) if n else None
        r["loss0_diff"] = abs(r["losses"][0] - ref["losses"][0]) if r["losses"] and ref["losses"] else None
        m = min(len(r["losses"]), len(ref["losses"]))
        r["loss_last_diff"] = abs(r["losses"][m - 1] - ref["losses"][m - 1]) if m else None
        timed = bool(r["steps_s"])
        rows.append([r["model"], r["world"], r["impl"],
                     f"{statistics.median(r['steps_s']):.2f}" if timed else "-",
                     f"{min(r['steps_s']):.2f}" if timed else "-",
                     f"{r['vs_ref']:.3f}" if r["vs_ref"] is not None else "-",
                     f"{r['losses'][0]:.6f}" if r["losses"] else "-",
                     f"{r['loss0_diff']:.1e}" if r["loss0_diff"] is not None else "-",
                     f"{r['loss_last_diff']:.1e}" if r["loss_last_diff"] is not None else "-",
                     f"crashed: `{r['error']}`" if r["error"] else ""])
    headers = ["model", "tp", "impl", "median step s", "min step s", "time / reference (paired)", "loss, step 0",
               "abs loss diff vs reference, step 0", "same, last step", "error"]
    table = markdown_table(headers, rows)
    print(table)
    controls = ", ".join(f"{r['vs_ref']:.3f}" for r in data if r["impl"] in (CONTROL, NATIVE_CONTROL) and r["vs_ref"])
    full = (args.hidden, args.heads, args.kv_heads, args.layers, args.batch, args.seq) == (1024, 8, 2, 4, 8, 512)
    size = (f"Llama: hidden {args.hidden}, {args.heads} heads, {args.kv_heads} kv heads, {args.layers} layers, "
            f"intermediate_size {args.intermediate}, vocabulary {args.vocab}; GPT-2: n_embd {args.hidden}, "
            f"{args.heads} heads, {args.layers} layers, n_inner {args.intermediate}, vocabulary {args.vocab}; "
            f"batch {args.batch} x {args.seq} tokens, fp32, 1D tp, gloo, AdamW(lr={args.lr}); "
            f"{args.steps} timed steps after {args.warmup} warm-up")
    note = (f"{size}{'' if full else ' (reduced size)'}. Reference: shardzoo.parallelize for the Llama rows, "
            "the native shardzoo GPT2 for the GPT-2 rows. Step times are the slowest rank's (a step ends on a barrier). "
            "The ratio is the median over steps of the paired ratio (every implementation runs once per round, in "
            "rotating order), so drifts of the shared machine cancel within a round. The control rows run the "
            f"reference a second time in each round: their distance from 1.000 ({controls or 'n/a'}) is the "
            "resolution of this host. Loss columns: the step-0 loss (all models start from the same weights), its "
            "difference from the reference's, and the same difference at the last step (each implementation runs "
            "its own AdamW). A crashed implementation is shown with the first line of its error and not timed.")
    write_results("parallelize", "parallelize: transformers Llama vs transformers' tensor parallelism, native GPT-2 "
                  "vs parallelized GPT2LMHeadModel (bench/parallelize.py)", table, {"config": cfg, "rows": data}, note)


if __name__ == "__main__":
    main()
