"""The block kernel's sliding window (query at position p sees the keys at positions > p - window)
on the torch reference (what CUDA runs windowed blocks on) and on torch's fused CPU op, against
SDPA with the window mask; forward and backward, padding rows that see no key included."""

import pytest
import torch

from shardzoo.kernels import flash_attention
from shardzoo.testing import assert_close, rms_of
from support.sequence_attention import full_inputs, make_mask, reference_grads


@pytest.mark.parametrize("backend", ["torch", "aten"])
@pytest.mark.parametrize("window", [1, 3, 12, 40])
def test_kernel_window_equals_sdpa(backend, window):
    q, k, v, dout = full_inputs(2, 2, 12, 8, torch.float64, window)
    mask = make_mask("random", 2, 12, 1, False, window)
    expected = reference_grads(q, k, v, dout, mask, True, window=window)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True, key_padding_mask=mask, window=window, backend=backend)
    out.backward(dout)
    # at window=1 a query sees one key: its dq (and that key's dk) cancels to exactly 0 in SDPA and
    # to rounding noise of the size of the gradients' terms here, so all three gradients' rms is the floor
    grad_floor = rms_of(expected[1:])
    for name, a, e in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), expected):
        # the kernel against SDPA in float64: softmax sums over the 12 keys, the output over them
        assert_close(a, e, f"{backend} window={window} {name}", terms=2 * 12 + 8,
                     floor=0.0 if name == "out" else grad_floor)


def test_kernel_window_refuses_bad_window_and_triton():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        flash_attention(q, q, q, causal=True, window=0)
    with pytest.raises(ValueError, match="backend='triton' has no sliding window"):
        from shardzoo.kernels.flash_attention import _resolve_attention_backend
        _resolve_attention_backend("triton", torch.device("cuda"), "op", window=True)
