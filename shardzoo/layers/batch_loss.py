"""The loss of a whole batch whose targets are split over mesh axes: the global mean over real
(non-ignored) targets, with gradients that stay exact once they are averaged over dp x sp.

A model's targets are split along the batch axes of its head's placement (tp rows), along the
sequence (sp) and across data-parallel replicas (dp); a rank holds one block. The layers sum
parameter gradients over the tp axes themselves, and data parallelism *averages* them over
dp x sp afterwards (``shardzoo.data_parallel``, ``training.average_grads``). So the loss
a rank backpropagates is

    R * local_sum / N      local_sum: this rank's per-target losses, summed
                           N: real targets of the whole step (every rank, every micro-batch)
                           R: size of the averaged axes (dp, sp) the targets are split over

and the averaged gradients are those of the global mean. The value every rank gets back is
the same number, ``sum over ranks of local_sum / N``: this call's share of the step's mean,
which is the mean itself when one call covers the whole step. A plain mean of each rank's own
targets would weigh ranks equally however many real targets each holds (zigzag sharding puts
every causal-LM batch's last, ignored position on sp rank 0).

``shift_labels`` turns transformers-style labels into causal-LM targets (position t predicts
token t+1), on the full sequence before it is sharded, so the shift crosses sp chunks.
"""

from __future__ import annotations

import math

import torch

from shardzoo.comm import ops

AVERAGED_AXES = ("dp", "sp")  # the axes data parallelism averages gradients over


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Causal-LM targets from transformers-style ``labels`` [B, S] -> [B, S]: position t's
    target is ``labels[:, t + 1]`` (the model predicts the next token) and the last position
    gets ``ignore_index``, as transformers' ``labels=`` loss shifts them; ``ignore_index`` in
    ``labels`` stays ignored. Shift the full sequence, then shard it: under sp the target of a
    chunk's last position is the next chunk's first label."""
    if labels.dim() != 2:
        raise ValueError(f"shift_labels: labels of shape {tuple(labels.shape)} must be [batch, seq] token ids (a "
                         f"causal LM's labels); pass the full sequence before it is sharded")
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def sum_over_axes(x: torch.Tensor, mesh, axes: tuple[str, ...]) -> torch.Tensor:
    """``x`` summed over the ranks spanned by ``axes`` (no autograd).

    One all-reduce over the combined group when the whole world runs this call together
    (pp=1): torch creates a combined group on first use collectively over every rank. With
    pipeline stages only the last stage gets here, so the sum runs over each axis's own group
    (those exist on every rank from the start), one small all-reduce per axis."""
    axes = tuple(a for a in mesh.expand_axes(*axes) if mesh.size(a) > 1) if axes else ()
    if len(axes) <= 1 or mesh.pp_size == 1:
        return ops.all_reduce(x, mesh.group(*axes)) if axes else x
    for axis in axes:
        x = ops.all_reduce(x, mesh.group(axis))
    return x


def count_targets(targets, mesh, axes: tuple[str, ...], ignore_index: int = -100) -> torch.Tensor:
    """Real targets (``!= ignore_index``) of the whole batch: int64 scalar, the same on every
    rank. ``targets``: this rank's block [...] of a batch split over ``axes``, or a list of
    such blocks (e.g. a step's micro-batches); one all-reduce over ``axes``."""
    blocks = [targets] if torch.is_tensor(targets) else list(targets)
    if not blocks:
        raise ValueError("count_targets needs at least one target tensor; pass this rank's targets of the step")
    local = sum((b != ignore_index).sum() for b in blocks).to(torch.int64)
    return sum_over_axes(local.reshape(1), mesh, axes).reshape(())


class _Share(torch.autograd.Function):
    """Forward: ``value`` (the batch's loss, the same on every rank). Backward: ``scale`` times
    the incoming gradient, into this rank's ``local`` sum."""

    @staticmethod
    def forward(ctx, local, value, scale):
        ctx.save_for_backward(scale)
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale, None, None


def reduce_loss(losses: torch.Tensor, counted: torch.Tensor, *, mesh, axes: tuple[str, ...], reduction: str = "mean",
               num_targets=None) -> torch.Tensor:
    """The loss of the whole batch from this rank's per-target losses (see the module doc).

    Args:
        losses: [...] this rank's per-target losses, 0 at ignored targets
            (``F.cross_entropy(..., reduction="none")``); identical on ranks that hold the
            same block (e.g. the vocabulary group of a vocab-parallel head).
        counted: bool [...] the real (non-ignored) targets among them.
        mesh, axes: the mesh and the axes the targets are split over (this rank holds one
            block); ranks along the other axes hold copies.
        reduction: "mean" (sum over every rank / real targets) or "sum" (sum over every rank).
        num_targets: with "mean", the real targets of the whole step (every rank and every
            micro-batch, e.g. from :func:`count_targets`) to divide by; default: the real
            targets of this call over ``axes``, counted in the same all-reduce as the sum.

    Returns a 0-dim tensor in ``losses.dtype``, the same on every rank. With no real target
    anywhere, "mean" is nan and the gradients are zero, as ``F.cross_entropy`` gives.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduce_loss: reduction={reduction!r} is not 'mean' or 'sum' (per-target losses, 'none', "
                         f"are this rank's own and need no reduction)")
    if num_targets is not None and reduction != "mean":
        raise ValueError(f"num_targets={num_targets} divides the 'mean' only; drop it for reduction={reduction!r}")
    if isinstance(num_targets, (int, float)) and not num_targets >= 0:
        raise ValueError(f"num_targets={num_targets} must be >= 0: the real targets of the whole step")
    stat = torch.promote_types(losses.dtype, torch.float32)
    local = losses.to(stat).sum()
    # the count in fp64: exact far beyond fp32's 2**24 tokens
    pair = sum_over_axes(torch.stack([local.detach(), counted.sum().to(stat)]).double(), mesh, axes)
    averaged = math.prod(mesh.size(a) for a in AVERAGED_AXES if a in axes)
    if reduction == "sum":
        value, scale = pair[0], torch.tensor(float(averaged), dtype=torch.float64, device=pair.device)
    else:
        count = pair[1] if num_targets is None else torch.as_tensor(num_targets, dtype=torch.float64,
                                                                    device=pair.device)
        value = pair[0] / count  # 0 / 0 = nan with no real target, as torch
        scale = torch.where(count > 0, averaged / count, torch.zeros_like(count))
    return _Share.apply(local, value.to(stat), scale.to(stat)).to(losses.dtype)
