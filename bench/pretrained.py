"""Memory of loading Hugging Face weights: ``GPT2.from_pretrained`` on 1, 2 and 4 ranks vs
transformers' ``GPT2LMHeadModel.from_pretrained`` in one process, and ``shardzoo.from_pretrained``
of a transformers ``LlamaForCausalLM`` (parallelized, 1D tp=2 and tp=4) vs transformers'
``LlamaForCausalLM.from_pretrained`` in one process; the load time of each.

The weights: a GPT-2 with random values saved by transformers (default the 124M-parameter
shape: 12 layers, hidden 768, vocabulary 50257; fp32 safetensors, ~500 MB), and a Llama of
about the same size (default 12 layers, hidden 768, 12 heads, 4 kv heads, intermediate_size
2048, vocabulary 32000, untied embeddings: 124M parameters), each written once to a scratch
directory. Each loader runs in a fresh process; its peak is the process's high-water
RSS during the load minus its RSS just before it (imports done, including the meta-device
machinery torch imports on its first use, about 80 MiB once per process; /proc/self/clear_refs reset),
so it counts the parameters, every temporary, and the file pages the load touched. The rank's
shard is the bytes of its own parameters: the floor for any loader.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._results import markdown_table, reset_peak_rss, rss_kib, write_results  # noqa: E402

MIB = 1 << 20


def _peak_since(base_kib: int) -> float:
    return (rss_kib("VmHWM") - base_kib) * 1024 / MIB


def write_weights(path: str, layers: int, hidden: int, heads: int, vocab: int) -> int:
    """Save a random GPT-2 of this shape with transformers; returns its parameter count."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_llama(path: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> int:
    """Save a random Llama of this shape with transformers; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, intermediate_size=intermediate,
                                         vocab_size=vocab))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def load_with_transformers(path: str, cls_name: str = "GPT2LMHeadModel") -> dict:
    """Peak RSS and time of ``transformers.<cls_name>.from_pretrained`` in this process."""
    import torch  # noqa: F401  (imports before the baseline)
    import transformers

    cls = getattr(transformers, cls_name)
    base = reset_peak_rss()
    start = time.perf_counter()
    model = cls.from_pretrained(path)
    for p in model.parameters():  # weights may still be lazily mapped from the file: touch them all
        p.detach().sum()
    seconds = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_mib": _peak_since(base), "shard_mib": shard / MIB, "seconds": seconds}


def load_with_shardzoo(path: str, layout: dict) -> dict:
    """Peak RSS and time of GPT2.from_pretrained on this rank."""
    import torch
    import torch.distributed as dist

    from shardzoo.comm import ParallelMesh
    from shardzoo.models import GPT2

    mesh = ParallelMesh(**layout)
    with torch.device("meta"):  # the meta-device machinery is imported on first use: import it before the
        torch.nn.Embedding(2, 2)  # baseline, as transformers' modules are imported before its own
    dist.barrier()
    base = reset_peak_rss()
    start = time.perf_counter()
    model = GPT2.from_pretrained(path, mesh=mesh)
    for p in model.parameters():  # as for transformers (here every value is already in memory)
        p.detach().sum()
    seconds = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_mib": _peak_since(base), "shard_mib": shard / MIB, "seconds": seconds}


def load_parallelized(path: str, layout: dict) -> dict:
    """Peak RSS and time of ``shardzoo.from_pretrained`` (a transformers model, parallelized) on this rank."""
    import torch
    import torch.distributed as dist
    import transformers

    import shardzoo
    from shardzoo.comm import ParallelMesh

    mesh = ParallelMesh(**layout)
    with torch.device("meta"):  # as in load_with_shardzoo: torch's meta-device machinery before the baseline
        torch.nn.Embedding(2, 2)
    transformers.CONFIG_MAPPING[transformers.AutoConfig.from_pretrained(path).model_type]  # and the model's modules,
    transformers.LlamaForCausalLM  # noqa: B018  (as load_with_transformers imports its class first)
    dist.barrier()
    base = reset_peak_rss()
    start = time.perf_counter()
    model = shardzoo.from_pretrained(path, mesh)
    for p in model.parameters():
        p.detach().sum()
    seconds = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_mib": _peak_since(base), "shard_mib": shard / MIB, "seconds": seconds}


def _fresh_process(fn_name: str, *args) -> dict:
    """Run ``fn_name(*args)`` of this file in a new interpreter; return its dict."""
    code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import pretrained as b; print('RESULT', json.dumps(b.{fn_name}(*{args!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    import json

    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--llama-layers", type=int, default=12)
    ap.add_argument("--llama-hidden", type=int, default=768)
    ap.add_argument("--llama-heads", type=int, default=12)
    ap.add_argument("--llama-kv-heads", type=int, default=4)
    ap.add_argument("--llama-intermediate", type=int, default=2048)
    ap.add_argument("--llama-vocab", type=int, default=32000)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed tensors leave RSS, so peaks are fair
    import shardzoo

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        path = os.path.join(root, "gpt2")
        params = write_weights(path, args.layers, args.hidden, args.heads, args.vocab)
        print(f"GPT-2 with {params / 1e6:.1f}M parameters written to {path}", flush=True)
        llama = os.path.join(root, "llama")
        llama_params = write_llama(llama, args.llama_layers, args.llama_hidden, args.llama_heads, args.llama_kv_heads,
                                   args.llama_intermediate, args.llama_vocab)
        print(f"Llama with {llama_params / 1e6:.1f}M parameters written to {llama}", flush=True)
        rows, data = [], {"params": params, "llama_params": llama_params, "runs": []}
        ref = _fresh_process("load_with_transformers", path, "GPT2LMHeadModel")
        cases = [("transformers GPT2LMHeadModel.from_pretrained", 1, [ref], ref)]
        for name, ranks, layout in [("shardzoo serial", 1, {}), ("shardzoo 1d tp=2", 2, {"tp": 2}),
                                    ("shardzoo 1d tp=4", 4, {"tp": 4}), ("shardzoo 2d tp=4", 4,
                                                                         {"tp": 4, "tp_mode": "2d"})]:
            cases.append((name, ranks, shardzoo.launch(load_with_shardzoo, ranks, path, layout), ref))
        llama_ref = _fresh_process("load_with_transformers", llama, "LlamaForCausalLM")
        cases.append(("Llama: transformers LlamaForCausalLM.from_pretrained", 1, [llama_ref], llama_ref))
        for name, ranks, layout in [("Llama: shardzoo.from_pretrained 1d tp=2", 2, {"tp": 2}),
                                    ("Llama: shardzoo.from_pretrained 1d tp=4", 4, {"tp": 4})]:
            cases.append((name, ranks, shardzoo.launch(load_parallelized, ranks, llama, layout), llama_ref))
        for name, ranks, results, reference in cases:
            worst = max(results, key=lambda r: r["peak_mib"])
            slowest = max(r["seconds"] for r in results)
            rows.append([name, ranks, f"{worst['shard_mib']:.0f}", f"{worst['peak_mib']:.0f}",
                         f"{worst['peak_mib'] / worst['shard_mib']:.2f}",
                         f"{worst['peak_mib'] / reference['peak_mib']:.2f}", f"{slowest:.2f}"])
            data["runs"].append({"name": name, "ranks": ranks, "per_rank": results})
        table = markdown_table(["loader", "ranks", "rank's shard MiB", "peak RSS MiB (worst rank)",
                                "peak / shard", "peak / transformers", "load s (slowest rank)"], rows)
        print(table)
        write_results("pretrained", "Loading Hugging Face weights: peak memory per rank", table, data,
                      f"GPT-2: {params / 1e6:.1f}M parameters (GPT2.from_pretrained, shardzoo's native family); "
                      f"Llama: {llama_params / 1e6:.1f}M parameters ({args.llama_layers} layers, hidden "
                      f"{args.llama_hidden}, {args.llama_heads} heads, {args.llama_kv_heads} kv heads, intermediate_size "
                      f"{args.llama_intermediate}, vocabulary {args.llama_vocab}; shardzoo.from_pretrained builds the "
                      "transformers model on the meta device and parallelizes it). 'peak / transformers' compares with "
                      "transformers' own loader of the same model in one process. "
                      "Peak = high-water RSS during the load minus the RSS just before it (imports done, including torch's "
                      "meta-device machinery, ~80 MiB once per process). Weights are touched after loading (transformers maps "
                      "them lazily). "
                      "All ranks share this machine's page cache; the file pages a rank touches count in its RSS.")


if __name__ == "__main__":
    main()
