"""Backend dispatch and input errors (importing without Triton: tests/test_package.py)."""
import importlib
import os

import pytest
import torch

from shardzoo.kernels import _dispatch, attention_block_backward, attention_block_forward
from shardzoo.kernels._triton import HAS_TRITON, interpreting
from shardzoo.testing.kernels import DEVICE, needs_triton

# the package exports a function of the same name, so fetch the module itself
flash_attention_module = importlib.import_module("shardzoo.kernels.flash_attention")


def qkv(b=1, h=2, sq=5, sk=6, d=32, dtype=torch.float32):
    return (torch.randn(b, h, s, d, dtype=dtype, device=DEVICE) for s in (sq, sk, sk))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the kernels are compiled, not interpreted")
def test_conftest_enables_the_triton_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    if HAS_TRITON:
        assert interpreting()


def test_auto_uses_triton_exactly_for_cuda_tensors(monkeypatch):
    calls = []

    class Spy:
        MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128

        @staticmethod
        def attention_forward_triton(*args):
            calls.append("triton")
            return flash_attention_module._ref.attention_forward_torch(*args)

    monkeypatch.setattr(flash_attention_module, "_triton_module", lambda: Spy)
    attention_block_forward(*qkv(), backend="auto")
    assert calls == (["triton"] if DEVICE.type == "cuda" and HAS_TRITON else [])
    attention_block_forward(*qkv(), backend="torch")
    assert len(calls) <= 1


def spy_on_aten(monkeypatch) -> list:
    """Record a call of the fused CPU forward (it still runs) in the returned list."""
    cpu = flash_attention_module._cpu
    calls = []
    real = cpu.attention_forward_aten
    monkeypatch.setattr(cpu, "attention_forward_aten", lambda *a: calls.append("aten") or real(*a))
    return calls


def test_auto_uses_the_fused_cpu_kernel_for_cpu_tensors(monkeypatch):
    calls = spy_on_aten(monkeypatch)
    q, k, v = (t.cpu() for t in qkv())
    attention_block_forward(q, k, v, backend="auto")
    assert calls == (["aten"] if flash_attention_module._cpu.available() else [])
    attention_block_forward(q, k, v, backend="torch")
    assert len(calls) <= 1


def test_aten_backend_on_a_cuda_tensor_is_a_clear_error(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(flash_attention_module._cpu, "available", lambda: False)
    with pytest.raises(ValueError, match="backend='aten' runs CPU tensors"):
        attention_block_forward(q, k, v, backend="aten")


def test_cpu_backends_accept_non_contiguous_inputs():
    # [B, S, H, D] storage viewed as [B, H, S, D], as attention layers produce it
    q, k, v = (torch.randn(2, s, 3, 48).transpose(1, 2) for s in (13, 21, 21))
    kpm = torch.rand(2, 21) > 0.2
    dout = torch.randn(2, 13, 3, 48).transpose(1, 2)
    for causal in (False, True):
        got = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend="aten")
        want = attention_block_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                       key_padding_mask=kpm, backend="torch")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
        out, lse = want
        got = attention_block_backward(dout, q, k, v, out, lse, causal=causal, key_padding_mask=kpm, backend="aten")
        want = attention_block_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, lse,
                                        causal=causal, key_padding_mask=kpm, backend="torch")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton not installed: the missing package is the error here (see the no-triton test)")
    monkeypatch.setattr(_dispatch, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_block_forward(*(t.cpu() for t in qkv()), backend="triton")


@pytest.mark.parametrize(
    "shapes, kwargs, message",
    [
        (dict(d=8), dict(backend="triton"), r"head_dim=8 is outside 16..128"),
        (dict(d=256), dict(backend="triton"), r"head_dim=256 is outside 16..128"),
        (dict(dtype=torch.float64), dict(backend="triton"), r"q.dtype=torch.float64 is not supported by the Triton"),
        (dict(dtype=torch.int32), dict(backend="torch"), r"q.dtype=torch.int32 is not supported"),
        (dict(), dict(backend="gpu"), r"backend='gpu' is not one of"),
        (dict(), dict(key_padding_mask=torch.ones(1, 5, dtype=torch.bool)), r"key_padding_mask shape \(1, 5\)"),
        (dict(), dict(key_padding_mask=torch.ones(1, 6)), r"key_padding_mask.dtype=torch.float32"),
    ],
)
def test_attention_input_errors(shapes, kwargs, message):
    if kwargs.get("backend") == "triton" and not (HAS_TRITON and (DEVICE.type == "cuda" or interpreting())):
        pytest.skip("needs a runnable triton backend to reach the triton-specific checks")
    if "key_padding_mask" in kwargs:
        kwargs["key_padding_mask"] = kwargs["key_padding_mask"].to(DEVICE)
    dtype = shapes.pop("dtype", torch.float32)
    if dtype == torch.int32:
        q, k, v = (torch.ones(1, 2, 5, 32, dtype=dtype, device=DEVICE) for _ in range(3))
    else:
        q, k, v = qkv(dtype=dtype, **shapes)
    with pytest.raises(ValueError, match=message):
        attention_block_forward(q, k, v, **kwargs)


def test_attention_shape_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="must agree on batch, heads and head_dim"):
        attention_block_forward(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention_block_forward(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="must share a dtype"):
        attention_block_forward(q, k.half(), v)
    out, lse = attention_block_forward(q, k, v)
    with pytest.raises(ValueError, match=r"lse shape \(1, 2\) must be \[B, H, Sq\]"):
        attention_block_backward(out, q, k, v, out, lse[:, :, 0], backend="torch")


@needs_triton
def test_triton_accepts_non_contiguous_inputs():
    # [B, S, H, D] storage viewed as [B, H, S, D], as attention layers produce it
    q, k, v = (torch.randn(2, s, 3, 48, device=DEVICE).transpose(1, 2) for s in (13, 21, 21))
    kpm = torch.rand(2, 21, device=DEVICE) > 0.2
    for causal in (False, True):
        out, lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend="triton")
        ref_out, ref_lse = attention_block_forward(q, k, v, causal=causal, key_padding_mask=kpm, backend="torch")
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        dout = torch.randn(2, 13, 3, 48, device=DEVICE).transpose(1, 2)
        got = attention_block_backward(dout, q, k, v, out, lse, causal=causal, key_padding_mask=kpm, backend="triton")
        want = attention_block_backward(dout, q, k, v, out, lse, causal=causal, key_padding_mask=kpm, backend="torch")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_auto_runs_cpu_dropout_on_the_reference(monkeypatch):
    """torch's fused CPU op cannot take the stateless mask: "auto" must not pick it."""
    calls = spy_on_aten(monkeypatch)
    q, k, v = (t.cpu() for t in qkv())
    got = attention_block_forward(q, k, v, backend="auto", dropout_p=0.5, dropout_seed=1)
    want = attention_block_forward(q, k, v, backend="torch", dropout_p=0.5, dropout_seed=1)
    assert calls == [] and all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="backend='aten'.*cannot apply the stateless dropout mask"):
        attention_block_forward(q, k, v, backend="aten", dropout_p=0.5, dropout_seed=1)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dropout_p=1.0, dropout_seed=1), r"dropout_p=1.0 must be a float in \[0, 1\)"),
    (dict(dropout_p=0.1), "needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=1, q_positions=torch.arange(4)), r"q_positions must be an int64 tensor \[5\]"),
    (dict(dropout_p=0.1, dropout_seed=1, head_offset=-1), "head_offset=-1 must be a non-negative int"),
])
def test_bad_dropout_arguments_are_clear_errors(kwargs, message):
    q, k, v = (t.cpu() for t in qkv())
    with pytest.raises(ValueError, match=message):
        attention_block_forward(q, k, v, backend="torch", **kwargs)
