"""Comparisons used by parallel-vs-serial tests, at the bound of ``testing.dtypes.reorder_bound``.

Each assert also records the fraction of its bound it used (``testing.margins``), so a run with
``pytest --margins`` lists the comparisons closest to failing.
"""

from __future__ import annotations

import torch

from shardzoo.testing import margins
from shardzoo.testing.dtypes import TOLERANCES, magnitude, measured_noise, reorder_bound, unit_roundoff


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for ``dtype`` from ``TOLERANCES`` (a torch.testing-style pair; the asserts
    below use ``reorder_bound`` instead)."""
    return TOLERANCES[dtype]


def _check(actual: torch.Tensor, expected: torch.Tensor, allowed: torch.Tensor, err: torch.Tensor, what: str,
           how: str) -> None:
    """Record the fraction of ``allowed`` used and raise naming the worst element if over."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what} differs: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if err.numel() == 0:
        return
    ratio = err / allowed
    if bool(torch.isnan(err).any()):
        ratio = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), ratio)
    used = float(ratio.max())
    margins.record(what, used, expected.dtype)
    if used > 1.0:
        i = int(ratio.flatten().argmax())
        raise AssertionError(
            f"{what} differs: {int((ratio > 1).sum())} of {err.numel()} elements exceed the allowed difference; "
            f"worst at flat index {i}: |{actual.flatten()[i].item():.8g} - {expected.flatten()[i].item():.8g}| = "
            f"{err.flatten()[i].item():.3g} > {allowed.flatten()[i].item():.3g} ({how})")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", scale: float = 1.0,
                 terms: int = 1, parts: int = 1, floor: float | torch.Tensor = 0.0, condition: float = 1.0) -> None:
    """|actual - expected| <= 2 x ``reorder_bound(expected, terms, parts)`` x ``scale``, element-wise.

    ``actual`` and ``expected`` are two evaluations of the same math in ``expected.dtype`` (say
    parallel and serial); each is within ``reorder_bound`` of the exact result, so they are within
    twice it of each other. ``terms``: the number of roundings an element goes through (the sum
    of the lengths of the reductions on its path: widths, vocabulary, sequence); ``parts``: the
    partial sums the parallel path adds (tp or the ranks it sums over). Without an fp64 twin the
    bound rests on ``terms`` alone; :func:`assert_close_conditioned` measures it instead.
    ``floor``: the summands' size where the tensor itself may cancel to nothing (``rms_of`` the
    model's gradients for a gradient), a float or a tensor of its shape (each element's own);
    ``condition``: how much the math amplifies a rounding
    (1 + max |logit| through a softmax; see ``reorder_bound``)."""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what} differs: dtype {actual.dtype} != expected {expected.dtype}")
    bound = 2.0 * scale * reorder_bound(expected, expected.dtype, terms, parts, floor=floor, condition=condition)
    err = (actual.detach().double() - expected.detach().double()).abs()
    _check(actual, expected, bound, err, what, f"the reorder bound for {terms} terms and {parts} parts in "
                                               f"{expected.dtype}, x{2 * scale:g} for two evaluations")


def assert_close_conditioned(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, what: str = "tensor",
                             scale: float = 1.0, slack: float = 1.0, terms: int = 1, parts: int = 1,
                             gauge: torch.Tensor | None = None, floor: float | torch.Tensor = 0.0,
                             condition: float = 1.0, computed_in: torch.dtype | None = None) -> None:
    """|actual - exact| <= ``reorder_bound`` with the noise the serial run measures, element-wise.

    ``expected`` is the serial result in ``actual``'s dtype and ``exact`` the same serial math in
    float64. The noise per unit of scale is the largest of the a priori estimate (``terms``,
    ``parts``), the serial run's root-mean-square error over the tensor, and, element by element,
    ``slack`` times that element's own serial error: where the problem is ill-conditioned (a
    LayerNorm input gradient when a row's variance is tiny, an Adam step where the second moment
    is tiny) the serial fp32 result is itself far from ``exact``, and a parallel one may be as far.

    In float64 the serial result is the most exact one there is, so its error cannot be measured;
    ``gauge``, the same serial math run in float32, measures the conditioning instead: its noise
    against ``exact``, in units of float32's roundoff, is the same number of float64 roundoffs.
    ``floor``: the summands' size where the result may cancel to nothing (as for
    :func:`assert_close`). ``computed_in``: the narrower dtype a result was computed in before it
    was widened to ``actual``'s (a float32 loss of bfloat16 logits); its roundoff sets the bound."""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what} differs: dtype {actual.dtype} != expected {expected.dtype}")
    if expected.shape != exact.shape:
        raise AssertionError(f"{what}: serial shape {tuple(expected.shape)} != fp64 shape {tuple(exact.shape)}")
    x = exact.detach().double()
    if gauge is not None and gauge.dtype != expected.dtype:
        serial, rescale = gauge, unit_roundoff(expected.dtype) / unit_roundoff(gauge.dtype)
    else:
        serial, rescale = expected, 1.0
    noise = measured_noise(serial, x, floor) * rescale
    own = slack * rescale * (serial.detach().double() - x).abs() / magnitude(x, expected.dtype, floor)
    dtype = computed_in if computed_in is not None else expected.dtype
    allowed = scale * reorder_bound(x, dtype, terms, parts, torch.clamp(own, min=noise), floor, condition)
    err = (actual.detach().double() - x).abs()
    _check(actual, expected, allowed, err, what,
           f"the reorder bound in {dtype} for {terms} terms and {parts} parts, with the serial run's noise "
           f"{noise:.3g} per unit of scale or {slack:g} x this element's own serial error against float64")


def error_messages(calls, error: type[Exception] = ValueError) -> list[str | None]:
    """The message of the ``error`` each zero-argument call raises, or None for a call that
    returns (so a test can assert both which calls were refused and what each refusal says)."""
    messages: list[str | None] = []
    for call in calls:
        try:
            call()
            messages.append(None)
        except error as e:
            messages.append(str(e))
    return messages
