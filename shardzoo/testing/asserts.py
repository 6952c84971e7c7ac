"""Comparisons used by parallel-vs-serial tests, at the tolerances of testing/dtypes.py."""

from __future__ import annotations

import torch

from shardzoo.testing.dtypes import TOLERANCES


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for ``dtype`` from ``TOLERANCES``."""
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", scale: float = 1.0) -> None:
    """``torch.testing.assert_close`` with the dtype's tolerance (times ``scale``) and a label."""
    rtol, atol = tolerance(expected.dtype)
    torch.testing.assert_close(
        actual, expected, rtol=rtol * scale, atol=atol * scale, msg=lambda m: f"{what} differs: {m}"
    )


def assert_close_conditioned(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, what: str = "tensor",
                             scale: float = 1.0, slack: float = 4.0) -> None:
    """Like :func:`assert_close`, plus ``slack`` times the reference's own rounding error.

    ``expected`` is the serial result in ``actual``'s dtype and ``exact`` the same serial math in
    float64. Where the problem is ill-conditioned (e.g. a LayerNorm input gradient when a row's
    variance is tiny) the serial fp32 result is itself far from ``exact``; a parallel result may
    differ from it by a few times that error, and not more."""
    rtol, atol = tolerance(expected.dtype)
    err = (actual.double() - expected.double()).abs()
    allowed = atol * scale + rtol * scale * expected.double().abs() + slack * (expected.double() - exact.double()).abs()
    bad = err > allowed
    if bool(bad.any()):
        i = int((err - allowed).flatten().argmax())
        raise AssertionError(
            f"{what} differs: {int(bad.sum())} of {err.numel()} elements exceed the allowed difference; worst at flat "
            f"index {i}: |{actual.flatten()[i].item():.8g} - {expected.flatten()[i].item():.8g}| = "
            f"{err.flatten()[i].item():.3g} > {allowed.flatten()[i].item():.3g} (atol {atol * scale:g}, rtol "
            f"{rtol * scale:g}, plus {slack:g} x the serial {expected.dtype} error against float64, "
            f"{(expected.double() - exact.double()).abs().flatten()[i].item():.3g})")


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
