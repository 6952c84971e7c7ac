"""Cross-entropy pieces for a vocab-parallel loss, plus a serial convenience loss.

Each rank holds logits [N, V_local] for vocab ids [vocab_start, vocab_start + V_local).
:func:`cross_entropy_partials` gives per-row statistics that combine across ranks
(max, then sum_exp rescaled, target_logit and sum_logits summed) into the global
lse = max + log(sum_exp); :func:`cross_entropy_grad` turns that lse into the local gradient.
Layering: Triton kernels (``cross_entropy_triton``) -> launch functions -> torch reference
with the same signature -> :class:`CrossEntropyFunction` -> :func:`cross_entropy`.
"""
from __future__ import annotations

import torch

from ._dispatch import HALF_AND_SINGLE, check_same_device, check_tensor, check_triton_float, resolve_backend

_FLOATS = HALF_AND_SINGLE + (torch.float64,)
_INTS = (torch.int64, torch.int32)
_REDUCTIONS = ("mean", "sum", "none")


def _triton_module():
    from . import cross_entropy_triton

    return cross_entropy_triton


def _local_target(target, vocab_start, v):
    """(local index clamped into range, bool [N] target is on this rank and not ignored)."""
    local = target.long() - vocab_start
    in_range = (target >= 0) & (local >= 0) & (local < v)
    return local.clamp(0, max(v - 1, 0)), in_range


def _stat_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def cross_entropy_partials_torch(logits, target, vocab_start):
    """Reference: logits [N, V_local], target [N] -> (row_max, sum_exp, target_logit, sum_logits) fp32 [N]
    (fp64 for fp64 logits). V_local = 0 gives (-inf, 0, 0, 0)."""
    x = logits.to(_stat_dtype(logits))
    n, v = x.shape
    if v == 0:
        zeros = x.new_zeros(n)
        return torch.full_like(zeros, float("-inf")), zeros, zeros.clone(), zeros.clone()
    row_max = x.amax(-1)
    shift = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    sum_exp = torch.exp(x - shift[:, None]).sum(-1)
    local, in_range = _local_target(target, vocab_start, v)
    target_logit = torch.where(in_range, x.gather(1, local[:, None]).squeeze(1), torch.zeros_like(row_max))
    return row_max, sum_exp, target_logit, x.sum(-1)


def cross_entropy_grad_torch(logits, target, vocab_start, lse, grad_row, label_smoothing, vocab_size):
    """Reference: dlogits [N, V_local] = grad_row * (softmax - (1-ls)*onehot - ls/vocab_size)."""
    ct = _stat_dtype(logits)
    x = logits.to(ct)
    grad = torch.exp(x - lse.to(ct)[:, None]) - label_smoothing / vocab_size
    local, in_range = _local_target(target, vocab_start, x.shape[1])
    rows = torch.nonzero(in_range).squeeze(1)
    grad[rows, local[rows]] -= 1.0 - label_smoothing
    grad = grad * grad_row.to(ct)[:, None]
    grad = torch.where((target >= 0)[:, None], grad, torch.zeros_like(grad))  # ignored rows: exactly 0
    return grad.to(logits.dtype)


def _check(op, logits, target, vocab_start, backend):
    check_tensor(op, "logits", logits, ndim=2, dtypes=_FLOATS, layout="[N, V_local]")
    check_tensor(op, "target", target, ndim=1, dtypes=_INTS, layout="[N]")
    if target.shape[0] != logits.shape[0]:
        raise ValueError(f"{op}: target has {target.shape[0]} rows but logits has {logits.shape[0]}; "
                         "pass one target per logits row ([N] and [N, V_local])")
    if int(vocab_start) < 0:
        raise ValueError(f"{op}: vocab_start={vocab_start} must be >= 0 (first vocab id held by this rank)")
    check_same_device(op, logits=logits, target=target)
    backend = resolve_backend(backend, logits.device, op)
    if backend == "triton":
        check_triton_float(op, "logits", logits)
    return backend


def cross_entropy_partials(logits, target, vocab_start=0, backend="auto"):
    """Per-row statistics of local logits.

    Args: logits [N, V_local]; target [N] int (negative = ignored); vocab_start: first local vocab id.
    Returns: fp32 [N] each (fp64 for fp64 logits, torch backend): row_max (max local logit, -inf when
    V_local = 0), sum_exp (sum exp(logit - row_max)), target_logit (logit of the target when it is
    local, else 0), sum_logits (sum of local logits).
    """
    backend = _check("cross_entropy_partials", logits, target, vocab_start, backend)
    if backend == "triton":
        return _triton_module().cross_entropy_partials_triton(logits, target, vocab_start)
    return cross_entropy_partials_torch(logits, target, vocab_start)


def cross_entropy_grad(logits, target, vocab_start, lse, grad_row, label_smoothing=0.0, vocab_size=None,
                       backend="auto"):
    """Gradient of the (label-smoothed) loss w.r.t. local logits.

    Args: logits [N, V_local]; target [N]; lse [N] global log-sum-exp; grad_row [N] upstream
    gradient per row; vocab_size: global vocab (default V_local, i.e. serial).
    Returns: dlogits [N, V_local] in logits' dtype; rows with a negative target are 0.
    """
    op = "cross_entropy_grad"
    backend = _check(op, logits, target, vocab_start, backend)
    n = logits.shape[0]
    for name, t in (("lse", lse), ("grad_row", grad_row)):
        check_tensor(op, name, t, ndim=1, dtypes=_FLOATS, layout="[N]")
        if t.shape[0] != n:
            raise ValueError(f"{op}: {name} has {t.shape[0]} rows but logits has {n}; pass a [N] {name}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    vocab_size = logits.shape[1] if vocab_size is None else int(vocab_size)
    if vocab_size < logits.shape[1]:
        raise ValueError(f"{op}: vocab_size={vocab_size} is smaller than the local vocab {logits.shape[1]}; "
                         "pass the global vocab size")
    if backend == "triton":
        return _triton_module().cross_entropy_grad_triton(logits, target, vocab_start, lse, grad_row,
                                                          label_smoothing, vocab_size)
    return cross_entropy_grad_torch(logits, target, vocab_start, lse, grad_row, label_smoothing, vocab_size)


class CrossEntropyFunction(torch.autograd.Function):
    """Serial loss from the partials (vocab_start=0); ``target`` uses -1 for ignored rows."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, reduction, backend):
        row_max, sum_exp, target_logit, sum_logits = cross_entropy_partials(logits, target, 0, backend)
        lse = row_max + torch.log(sum_exp)
        valid = target >= 0
        vocab = logits.shape[1]
        loss = lse - (1.0 - label_smoothing) * target_logit - label_smoothing * sum_logits / vocab
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        n_valid = valid.sum()
        ctx.save_for_backward(logits, target, lse, n_valid)
        ctx.settings = (label_smoothing, reduction, backend)
        if reduction == "none":
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / n_valid if reduction == "mean" else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse, n_valid = ctx.saved_tensors
        label_smoothing, reduction, backend = ctx.settings
        grad = grad.to(lse.dtype)  # fp32, or fp64 for fp64 logits
        if reduction == "none":
            grad_row = grad
        else:
            grad_row = (grad / n_valid if reduction == "mean" else grad).expand(logits.shape[0])
        dlogits = cross_entropy_grad(logits, target, 0, lse, grad_row.contiguous(), label_smoothing,
                                     logits.shape[1], backend)
        return dlogits, None, None, None, None


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", backend="auto"):
    """Serial cross entropy equal to ``F.cross_entropy`` for logits [..., V] and target [...].

    Returns a scalar for reduction "mean" / "sum", or per-row losses shaped like target for "none".
    """
    op = "cross_entropy"
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r} is not one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    check_tensor(op, "logits", logits, dtypes=_FLOATS)
    check_tensor(op, "target", target, dtypes=_INTS)
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: target shape {tuple(target.shape)} must be logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])} (class indices, not probabilities)")
    vocab = logits.shape[-1]
    flat_target = target.reshape(-1)
    ignored = flat_target == ignore_index
    bad = ~ignored & ((flat_target < 0) | (flat_target >= vocab))
    if bool(bad.any()):
        value = int(flat_target[bad][0])
        raise ValueError(f"{op}: target value {value} is outside [0, {vocab}) and is not ignore_index={ignore_index}; "
                         "fix the labels or set ignore_index")
    # the partials treat any negative target as ignored
    flat_target = torch.where(ignored, torch.full_like(flat_target, -1), flat_target)
    loss = CrossEntropyFunction.apply(logits.reshape(-1, vocab), flat_target, float(label_smoothing), reduction,
                                      backend)
    return loss.reshape(target.shape) if reduction == "none" else loss
