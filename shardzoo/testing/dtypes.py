"""Dtypes by name and every tolerance the tests compare with, each with where it comes from.

A test keeps its own dtype set by naming it: ``DTYPES = dtypes("fp32", "fp64")`` parametrizes
over those two names in that order. Pairs are (rtol, atol) except the kernel tolerances, which
are (atol, rtol) as ``shardzoo.testing.kernels.assert_close`` takes them.
"""

from __future__ import annotations

import math

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp64": torch.float64,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtypes(*names: str) -> dict[str, torch.dtype]:
    """The dtypes of ``names`` (keys of ``DTYPES``), in the order given."""
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype names {unknown}; use {', '.join(DTYPES)}")
    return {n: DTYPES[n] for n in names}


# (rtol, atol) per dtype: a torch.testing-style pair for callers that want one. The suite's own
# parallel-vs-serial asserts do not use it: they use reorder_bound below.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of ``dtype``: the largest relative error of one rounding to nearest."""
    return torch.finfo(dtype).eps / 2


# The failure probability the tail factor allows per element (see reorder_bound).
TAIL_PROBABILITY = 1e-9
# How much more rounding noise a parallel evaluation may carry than the serial one, as a multiple
# of its standard deviation (see reorder_bound).
REORDER_FACTOR = 2.0


def tail_factor(elements: int) -> float:
    """lambda(N) = sqrt(2 ln(2 N / TAIL_PROBABILITY)): a Gaussian error exceeds lambda standard
    deviations in any of N elements with probability at most TAIL_PROBABILITY."""
    return math.sqrt(2.0 * math.log(2.0 * max(int(elements), 1) / TAIL_PROBABILITY))


def reorder_bound(reference: torch.Tensor, dtype: torch.dtype, terms: int = 1, parts: int = 1,
                  noise: float | torch.Tensor = 0.0, floor: float | torch.Tensor = 0.0, condition: float = 1.0) -> torch.Tensor:
    """Per-element bound [same shape as ``reference``, float64] on |x - exact| for a result x
    computed in ``dtype`` by an evaluation order other than the serial one.

    The rule, derived once for every parallel-vs-serial comparison of the suite:

    * A tensor-parallel result computes the same math as the serial one in another order: the
      reductions it splits are summed as partial sums on each of ``parts`` ranks (each with the
      GEMM blocking of its own shard width) and then added by an all-reduce in the order of the
      collective. Every such order is a summation tree over the same summands, so the standard
      error analysis of summation (Higham, *Accuracy and Stability of Numerical Algorithms*,
      4.2) bounds both the serial and the parallel result by the same kind of quantity: the unit
      roundoff ``u`` times a function of the number of terms times the magnitude of the summands,
      whatever the vector unit or the thread count (those only change the tree).
    * The magnitude of the summands of element i is not its own value (a logit of -0.002 is the
      sum of terms of size 0.1 that cancel), so it is taken as ``|reference_i| + rms(reference)``:
      the element plus the typical size of the tensor it belongs to. A rounding error on element
      i is a multiple of this ``scale_i``. Where a whole tensor cancels (the gradient of a key
      bias, which softmax ignores, is exactly zero and computed as rounding noise) its own size
      says nothing: ``floor`` then gives the size of the summands from outside, e.g. the
      root-mean-square of all of a model's gradients (:func:`rms_of`).
    * The noise per unit of scale has two estimates, and the larger is used:
      - a priori, ``u * sqrt(terms + parts)``: summing n terms rounds n partial sums, each by at
        most u of its size, and the partial sums of terms of random sign grow as sqrt(k) times
        a term; the errors are independent to first order (Higham and Mary, 2019), so their
        standard deviation is about u sqrt(n) / 2.4 of the result's scale for a plain loop and
        less for blocked or pairwise sums. A chain of reductions adds their variances, so its
        lengths add under the root, and the all-reduce adds ``parts`` more terms. ``terms`` is
        the number of roundings an output element goes through (the sum over the chain of the
        lengths of the reductions: hidden width, vocabulary, sequence, tokens for a weight
        gradient) and ``parts`` the number of partial sums the parallel path adds (tp, or the
        ranks it sums over). ``condition`` multiplies it where the math itself amplifies a
        rounding: exp(x) turns an absolute error e of x into a relative error e, so a softmax
        over logits up to |z| has condition 1 + |z| (the textbook forward error = condition x
        backward error);
      - measured, ``noise``: the root-mean-square of (serial - exact) / scale over the tensor
        (:func:`measured_noise`), where an fp64 twin of the serial run exists. It carries what
        the a priori term does not: depth, nonlinearities, ill-conditioning. It may be a tensor
        (per element) where an element's own serial error tells its conditioning.
    * A parallel order differs from the serial one by at most one more level of partial sums per
      reduction; its noise is taken as at most ``REORDER_FACTOR`` (2) times the serial noise.
      Rounding errors of many independent roundings are close to Gaussian, so over N elements
      the largest stays below ``tail_factor(N)`` (about 7 to 9) standard deviations except with
      probability TAIL_PROBABILITY.

    The bound is ``tail_factor(N) * REORDER_FACTOR * max(condition u sqrt(terms + parts), noise) * scale_i``.
    With u = 6e-8 (fp32) and up to a few thousand terms it is 1e-6 to 1e-4 of the tensor's scale, while
    a wrong shard (a dropped block, a bias added twice, a gradient not summed over tp) is an error
    of 1e-2 to 1 of that scale: three orders of magnitude apart, on any CPU.
    """
    u = unit_roundoff(dtype)
    scale = magnitude(reference, dtype, floor)
    prior = float(condition) * u * math.sqrt(max(int(terms), 1) + max(int(parts), 1))
    sigma = torch.clamp(noise.double(), min=prior) if torch.is_tensor(noise) else max(prior, float(noise))
    return tail_factor(reference.numel()) * REORDER_FACTOR * sigma * scale


def magnitude(reference: torch.Tensor, dtype: torch.dtype, floor: float | torch.Tensor = 0.0) -> torch.Tensor:
    """scale_i = |reference_i| + max(rms(reference), floor) [float64]: the size of the summands
    behind each element (see reorder_bound). ``floor`` may be a tensor of ``reference``'s shape:
    each element's own summands' size, where one element cancels more than the others."""
    ref = reference.detach().double()
    rms = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
    least = max(rms, torch.finfo(dtype).tiny)
    if torch.is_tensor(floor):
        return ref.abs() + torch.clamp(floor.detach().double().expand_as(ref), min=least)
    return ref.abs() + max(least, float(floor))


def rms_of(tensors) -> float:
    """The root-mean-square of all elements of ``tensors`` together (None entries skipped): the
    ``floor`` of a family of tensors computed from the same summands, such as a model's gradients."""
    parts = [t.detach().double().flatten() for t in tensors if t is not None]
    return float(torch.cat(parts).pow(2).mean().sqrt()) if parts else 0.0


def measured_noise(serial: torch.Tensor, exact: torch.Tensor, floor: float | torch.Tensor = 0.0) -> float:
    """rms((serial - exact) / scale) over the tensor: the serial run's own rounding noise per
    unit of the scale ``reorder_bound`` uses (``scale_i = |exact_i| + max(rms(exact), floor)``)."""
    if exact.numel() == 0:
        return 0.0
    scale = magnitude(exact, serial.dtype, floor)
    return float(((serial.detach().double() - exact.detach().double()) / scale).pow(2).mean().sqrt())


# bf16 inputs vs the fp64 reference on the same rounded inputs (docs/sequence_parallel.md)
SEQUENCE_BF16_TOL = {"out": (2e-2, 2e-2), "grad": (5e-2, 5e-2)}

# bf16 compute (FSDP2 MixedPrecisionPolicy, fp32 master weights and reduce) after 3 AdamW steps
# against fp32 serial, relative L2 error of all weights together: measured 1.02e-2 (1d, tp=2,
# dp=2, zero 2 and 3 alike). Single tensors differ more where they are small: the biases start
# at zero, so after 3 steps they are only Adam's steps, whose signs bf16 noise flips (fc2.bias
# 0.14). The bound leaves 3x.
ZERO_BF16_REL_TOL = 3e-2

# (atol, rtol) of a kernel output against plain torch in fp32 on the same (upcast) inputs.
# Low-precision rows cover rounding the result to the input dtype (the interpreter rounds
# toward zero, so up to one full ulp) and, for gradients, the rounded `out` in D = rowsum(dO*O).
KERNEL_OUT_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
KERNEL_GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2)}
KERNEL_LSE_TOL = (1e-4, 1e-5)  # lse is fp32 from exactly upcast inputs, whatever the input dtype


def model_terms(hidden: int, layers: int, seq: int, tokens: int, vocab: int = 0, ffn: int | None = None) -> int:
    """``terms`` of ``reorder_bound`` for a transformer's outputs, loss and gradients: the
    reductions on the path of any element. Per block the attention's (query-key products over at
    most ``hidden``, the softmax and the value sum over ``seq`` keys, the output projection over
    ``hidden``) and the MLP's (``hidden`` in, ``ffn`` = 4 x hidden by default out); then the head
    over ``hidden`` and the loss over ``vocab``; a weight gradient adds its sum over ``tokens``
    (batch x sequence). A chain of reductions adds their lengths (their error variances add)."""
    ffn = 4 * hidden if ffn is None else ffn
    return layers * (2 * hidden + 2 * seq + hidden + ffn) + hidden + vocab + tokens


# ``terms`` for the suite's tiny transformer models (testing.hf_twins, the families' tiny configs,
# the README's and the checkpoints' models): width <= 64, 2 blocks with an MLP <= 4 x width,
# sequences <= 32, batch x sequence <= 256, vocabularies <= 128.
TINY_MODEL_TERMS = model_terms(hidden=64, layers=2, seq=32, tokens=256, vocab=128)
