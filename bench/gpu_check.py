"""Compile, check and time every Triton kernel of shardzoo.kernels on one CUDA GPU.

    python bench/gpu_check.py                  # realistic sizes, a few minutes on one H200
    python bench/gpu_check.py --quick          # small sizes, a smoke test
    python bench/gpu_check.py --no-compile     # skip the torch.compile peers (their compile time)

1. Correctness: each Triton kernel against the shardzoo torch reference (fp32 math) on the same
   inputs, as a relative error ||got - want|| / ||want|| per output, with a tolerance per dtype.
2. Time (triton.testing.do_bench, median ms; L2 flushed between runs), against peers in the same
   launch: attention vs SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends (TFLOP/s; causal counts
   half the FLOPs; fwd+bwd = 3.5x fwd); LayerNorm, bias+GeLU (tanh and exact) and cross entropy vs
   eager torch and torch.compile, forward and fwd+bwd (GB/s from a fixed minimal-traffic model, the
   same for both sides).
   ratio = shardzoo ms / peer ms (below 1: shardzoo is faster).
3. ZeRO-3 + CPU offload (bench/_zero_offload.py, 2 GPUs): a GPT-2 under
   ``shardzoo.data_parallel(model, mesh, zero=3, offload=True)`` vs without offload: peak GPU
   memory, step time and the loss (which must agree); skipped with fewer than 2 GPUs.

Writes bench/results/gpu_check.json and this benchmark's section of bench/RESULTS.md.
Exits non-zero without CUDA, or when a correctness check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root, when shardzoo is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import markdown_table, write_results  # noqa: E402
from _zero_offload import run_zero3_offload  # noqa: E402
from shardzoo.kernels import (  # noqa: E402
    HAS_TRITON,
    attention_block_backward,
    attention_block_forward,
    bias_gelu,
    bias_gelu_backward,
    bias_gelu_forward,
    cross_entropy,
    cross_entropy_grad,
    cross_entropy_partials,
    flash_attention,
    fused_layer_norm,
    layer_norm_backward,
    layer_norm_forward,
)

CHECKS: list[dict] = []
TIMINGS: list[dict] = []
LOW_PRECISION_TOL, GRAD_LOW_PRECISION_TOL, FP32_TOL = 1e-2, 2e-2, 1e-4
BUDGET_S = 300  # the whole script, compile times included, on one H200


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False). This script compiles and times "
            "the Triton kernels on a GPU. On a CPU machine run the kernel tests instead, which execute the "
            "same kernels in the Triton interpreter: python -m pytest tests/kernel_tests")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("gpu_check: TRITON_INTERPRET=1 is set, which would interpret the kernels on the CPU; "
                         "unset it to compile them for the GPU")
    if not HAS_TRITON:
        raise SystemExit("gpu_check: triton is not installed; pip install triton")


# ---------------------------------------------------------------- correctness


def check(kernel: str, case: str, quantity: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Record ||got - want|| / ||want|| over finite entries; a differing set of non-finite entries fails."""
    got, want = got.float(), want.float()
    same_pattern = torch.equal(torch.isfinite(got), torch.isfinite(want)) and torch.equal(got.isnan(), want.isnan())
    finite = torch.isfinite(want)
    err = float("inf")
    if same_pattern:
        diff = (got[finite] - want[finite]).norm()
        err = (diff / want[finite].norm().clamp_min(1e-30)).item()
    CHECKS.append(dict(kernel=kernel, case=case, quantity=quantity, rel_err=err, tol=tol, ok=err <= tol))


def _tols(dtype):
    low = dtype != torch.float32
    return (LOW_PRECISION_TOL if low else FP32_TOL), (GRAD_LOW_PRECISION_TOL if low else FP32_TOL)


def check_attention(b, h, sq, sk, d, dtype, causal, padded):
    case = f"B{b} H{h} Sq{sq} Sk{sk} D{d} {str(dtype)[6:]}{' causal' if causal else ''}{' padded' if padded else ''}"
    q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    kpm = None
    if padded:  # ragged key lengths, one batch row with no key at all
        lengths = torch.randint(sk // 2, sk + 1, (b,), device="cuda")
        lengths[0] = 0
        kpm = torch.arange(sk, device="cuda")[None, :] < lengths[:, None]
    args = dict(causal=causal, key_padding_mask=kpm)
    out, lse = attention_block_forward(q, k, v, backend="triton", **args)
    ref_out, ref_lse = attention_block_forward(q, k, v, backend="torch", **args)
    tol, grad_tol = _tols(dtype)
    check("attention", case, "out", out, ref_out, tol)
    check("attention", case, "lse", lse, ref_lse, FP32_TOL)
    grads = attention_block_backward(dout, q, k, v, ref_out, ref_lse, backend="triton", **args)
    ref_grads = attention_block_backward(dout, q, k, v, ref_out, ref_lse, backend="torch", **args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        check("attention", case, name, got, want, grad_tol)


def check_layer_norm(m, n, dtype):
    case = f"{m}x{n} {str(dtype)[6:]}"
    x = torch.randn(m, n, device="cuda", dtype=dtype) * 2 + 0.5
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    tol, grad_tol = _tols(dtype)
    got, want = layer_norm_forward(x, w, b, 1e-5, "triton"), layer_norm_forward(x, w, b, 1e-5, "torch")
    for name, g, r, t in zip(("y", "mean", "rstd"), got, want, (tol, FP32_TOL, FP32_TOL)):
        check("layer_norm", case, name, g, r, t)
    got = layer_norm_backward(dy, x, w, want[1], want[2], "triton")
    ref = layer_norm_backward(dy, x, w, want[1], want[2], "torch")
    for name, g, r, t in zip(("dx", "dweight", "dbias"), got, ref, (grad_tol, FP32_TOL, FP32_TOL)):
        check("layer_norm", case, name, g, r, t)


def check_bias_gelu(m, n, dtype, approximate):
    case = f"{m}x{n} {str(dtype)[6:]} {approximate}"
    x = torch.randn(m, n, device="cuda", dtype=dtype) * 3
    bias, dy = torch.randn(n, device="cuda", dtype=dtype), torch.randn_like(x)
    tol, grad_tol = _tols(dtype)
    check("bias_gelu", case, "y", bias_gelu_forward(x, bias, approximate, "triton"),
          bias_gelu_forward(x, bias, approximate, "torch"), tol)
    got, ref = bias_gelu_backward(dy, x, bias, approximate, "triton"), bias_gelu_backward(dy, x, bias, approximate, "torch")
    check("bias_gelu", case, "dx", got[0], ref[0], grad_tol)
    check("bias_gelu", case, "dbias", got[1], ref[1], grad_tol)  # sums of dx rounded to x.dtype


def _targets(n, v):
    target = torch.randint(0, v, (n,), device="cuda")
    target[torch.rand(n, device="cuda") < 0.05] = -100
    return target


def check_cross_entropy(n, v, dtype):
    case = f"{n}x{v} {str(dtype)[6:]}"
    logits = torch.randn(n, v, device="cuda", dtype=dtype) * 3
    target = _targets(n, v)
    # partials as rank 1 of 2 vocab shards
    start = v // 2
    got = cross_entropy_partials(logits[:, start:], target, start, "triton")
    ref = cross_entropy_partials(logits[:, start:], target, start, "torch")
    for name, g, r in zip(("row_max", "sum_exp", "target_logit", "sum_logits"), got, ref):
        check("cross_entropy", case, name, g, r, FP32_TOL)
    lse = torch.logsumexp(logits.float(), -1)
    grad_row = (target >= 0).float() / n
    g = cross_entropy_grad(logits[:, start:], target, start, lse, grad_row, 0.1, v, "triton")
    r = cross_entropy_grad(logits[:, start:], target, start, lse, grad_row, 0.1, v, "torch")
    check("cross_entropy", case, "dlogits", g, r, _tols(dtype)[1])
    check("cross_entropy", case, "serial loss vs F.cross_entropy", cross_entropy(logits, target, backend="triton"),
          F.cross_entropy(logits.float(), target), _tols(dtype)[0])  # the loss comes back in logits' dtype


# ---------------------------------------------------------------- timing


def bench(fn, grad_to_none=None) -> float:
    import triton.testing

    fn()  # compile / autotune-free warm start outside the timed region
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def record(kernel, case, pass_, unit, work, ours_ms, peer, peer_ms, note=""):
    rate = (lambda ms: work / (ms * 1e-3) / 1e12) if unit == "TFLOP/s" else (lambda ms: work / (ms * 1e-3) / 1e9)
    TIMINGS.append(dict(
        kernel=kernel, case=case, pass_=pass_, unit=unit, shardzoo_ms=ours_ms, shardzoo_rate=rate(ours_ms),
        peer=peer, peer_ms=peer_ms, peer_rate=rate(peer_ms) if peer_ms else None,
        ratio=ours_ms / peer_ms if peer_ms else None, note=note,
    ))


def time_attention(b, h, s, d, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    case = f"B{b} H{h} S{s} D{d} bf16{' causal' if causal else ''}"
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    with torch.no_grad():
        ours_f = bench(lambda: attention_block_forward(q, k, v, causal=causal, backend="triton"))
    ours_fb = bench(lambda: flash_attention(q, k, v, causal=causal, backend="triton").backward(dout), [q, k, v])
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        peer_f = peer_fb = None
        note = ""
        try:
            with sdpa_kernel(backend):
                with torch.no_grad():
                    peer_f = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                peer_fb = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout),
                                [q, k, v])
        except RuntimeError as err:  # backend not available for this GPU / build
            note = f"{name} unavailable: {str(err).splitlines()[0][:80]}"
        record("attention", case, "fwd", "TFLOP/s", flops, ours_f, name, peer_f, note)
        record("attention", case, "fwd+bwd", "TFLOP/s", 3.5 * flops, ours_fb, name, peer_fb, note)


def _compiled_peer(fn, use_compile):
    return torch.compile(fn) if use_compile else None


def time_elementwise(kernel, case, work_f, work_fb, ours_f, ours_fb, eager_f, eager_fb, compiled, grads, note=""):
    """Forward and fwd+bwd, each vs eager and (when ``compiled`` = (fwd, fwd+bwd)) torch.compile."""
    compiled_f, compiled_fb = compiled if compiled is not None else (None, None)
    with torch.no_grad():
        ours = bench(ours_f)
        record(kernel, case, "fwd", "GB/s", work_f, ours, "eager torch", bench(eager_f), note)
        if compiled_f is not None:
            record(kernel, case, "fwd", "GB/s", work_f, ours, "torch.compile", bench(compiled_f), note)
    ours = bench(ours_fb, grads)
    record(kernel, case, "fwd+bwd", "GB/s", work_fb, ours, "eager torch", bench(eager_fb, grads), note)
    if compiled_fb is not None:
        record(kernel, case, "fwd+bwd", "GB/s", work_fb, ours, "torch.compile", bench(compiled_fb, grads), note)


def time_layer_norm(m, n, use_compile):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dy = torch.randn_like(x)
    ln = lambda x, w, b: F.layer_norm(x, (n,), w, b)  # noqa: E731
    compiled = _compiled_peer(ln, use_compile)
    traffic = m * n * 2  # bytes of one bf16 pass over x
    time_elementwise(
        "layer_norm", f"{m}x{n} bf16", 2 * traffic, 5 * traffic,
        lambda: layer_norm_forward(x, w, b, 1e-5, "triton"), lambda: fused_layer_norm(x, w, b, backend="triton").backward(dy),
        lambda: ln(x, w, b), lambda: ln(x, w, b).backward(dy),
        (lambda: compiled(x, w, b), lambda: compiled(x, w, b).backward(dy)) if compiled else None, [x, w, b],
    )  # fmt: skip


def time_bias_gelu(m, n, approximate, use_compile):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    eager = lambda x, b: F.gelu(x + b, approximate=approximate)  # noqa: E731
    compiled = _compiled_peer(eager, use_compile)
    traffic = m * n * 2
    time_elementwise(
        "bias_gelu", f"{m}x{n} bf16 {approximate}", 2 * traffic, 5 * traffic,
        lambda: bias_gelu_forward(x, bias, approximate, "triton"),
        lambda: bias_gelu(x, bias, approximate, "triton").backward(dy),
        lambda: eager(x, bias), lambda: eager(x, bias).backward(dy),
        (lambda: compiled(x, bias), lambda: compiled(x, bias).backward(dy)) if compiled else None, [x, bias],
    )  # fmt: skip


def time_cross_entropy(n, v, use_compile):
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = _targets(n, v)
    compiled = _compiled_peer(F.cross_entropy, use_compile)
    traffic = n * v * 2
    time_elementwise(
        "cross_entropy", f"{n}x{v} bf16", traffic, 3 * traffic,
        lambda: cross_entropy(logits, target, backend="triton"),
        lambda: cross_entropy(logits, target, backend="triton").backward(),
        lambda: F.cross_entropy(logits, target), lambda: F.cross_entropy(logits, target).backward(),
        (lambda: compiled(logits, target), lambda: compiled(logits, target).backward()) if compiled else None,
        [logits], note="cross_entropy: shardzoo's timed calls include one host sync (its label range check)",
    )  # fmt: skip


# ---------------------------------------------------------------- main


def _fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    args = parser.parse_args()
    require_cuda()
    torch.manual_seed(0)
    start = time.time()
    s, ln_rows, ce_rows = (1024, 2048, 1024) if args.quick else (4096, 16384, 8192)

    print(f"checking kernels on {torch.cuda.get_device_name(0)} ...", flush=True)
    for d in (64, 128):
        for causal in (False, True):
            check_attention(4, 16, s, s, d, torch.bfloat16, causal, padded=False)
    check_attention(2, 8, 1000, 1533, 96, torch.float16, True, padded=True)  # ragged, padded head dim
    check_attention(2, 4, 777, 513, 80, torch.bfloat16, False, padded=True)
    check_attention(2, 4, 300, 257, 64, torch.float32, True, padded=True)  # fp32 / ieee path
    check_attention(2, 8, 512, 512, 32, torch.bfloat16, True, padded=False)  # smallest supported head dim
    check_layer_norm(ln_rows, 4096, torch.bfloat16)
    check_layer_norm(1000, 1000, torch.float32)
    check_bias_gelu(ce_rows, 4 * 4096 if not args.quick else 4096, torch.bfloat16, "tanh")
    check_bias_gelu(1000, 3000, torch.float32, "none")
    check_cross_entropy(ce_rows, 50304, torch.bfloat16)
    check_cross_entropy(333, 1000, torch.float32)
    failed = [c for c in CHECKS if not c["ok"]]
    print(markdown_table(["kernel", "case", "output", "rel err", "tol", "ok"],
                         [[c["kernel"], c["case"], c["quantity"], _fmt(c["rel_err"], 2), c["tol"], c["ok"]]
                          for c in CHECKS]))
    print(f"\n{len(CHECKS) - len(failed)}/{len(CHECKS)} checks passed ({time.time() - start:.0f} s)\n", flush=True)

    print("timing ...", flush=True)
    for d in (64, 128):
        for causal in (False, True):
            time_attention(4, 16, s, d, causal)
    use_compile = not args.no_compile
    time_layer_norm(ln_rows, 4096, use_compile)
    for approximate in ("tanh", "none"):
        time_bias_gelu(ce_rows, 4 * 4096 if not args.quick else 4096, approximate, use_compile)
    time_cross_entropy(ce_rows, 50304, use_compile)

    headers = ["kernel", "case", "pass", "shardzoo ms", "shardzoo rate", "peer", "peer ms", "peer rate", "ratio"]
    rows = [[t["kernel"], t["case"], t["pass_"], _fmt(t["shardzoo_ms"]), f"{_fmt(t['shardzoo_rate'])} {t['unit']}",
             t["peer"], _fmt(t["peer_ms"]), f"{_fmt(t['peer_rate'])} {t['unit']}", _fmt(t["ratio"])]
            for t in TIMINGS]
    table = markdown_table(headers, rows)
    print(table)
    notes = sorted({t["note"] for t in TIMINGS if t["note"]})
    for note in notes:
        print(note)
    print("zero=3 + offload ...", flush=True)
    zero_rows = run_zero3_offload()
    zero_note = ("ZeRO-3 offload (2 GPUs, dp=2): " + "; ".join(
        f"offload={r['offload']}: peak {r['peak_mib']:.0f} MiB, {r['step_ms']:.1f} ms/step, loss {r['loss']:.4f}"
        for r in zero_rows) + "." if zero_rows else "ZeRO-3 offload: skipped (needs 2 GPUs for a dp group).")
    print(zero_note)
    notes.append(zero_note)
    elapsed = time.time() - start
    summary = (f"ratio = shardzoo ms / peer ms (below 1: shardzoo faster). Correctness: "
               f"{len(CHECKS) - len(failed)}/{len(CHECKS)} checks within tolerance. Total {elapsed:.0f} s "
               f"({'within' if elapsed <= BUDGET_S else 'OVER'} the {BUDGET_S} s budget).")
    print(f"\n{summary}")
    write_results("gpu_check", "Triton kernels vs torch on one GPU (bench/gpu_check.py)", table,
                  dict(checks=CHECKS, timings=TIMINGS, zero3_offload=zero_rows, elapsed_s=elapsed), note=" ".join([summary, *notes]))
    if failed:
        print(f"FAILED checks: {[(c['kernel'], c['case'], c['quantity']) for c in failed]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
