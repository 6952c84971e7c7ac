"""The loss of every model family: the global token mean (layers/batch_loss.py), with the
step's count of real targets for micro-batches (``count_targets``). Mixed into
``pipeline.StagedModel``; uses its ``mesh``, ``is_last``, ``head_name`` and, on the last stage,
``target_placement`` (the batch placement of the head's output)."""

from __future__ import annotations

import torch

from shardzoo.layers import batch_loss


class GlobalLoss:
    """``loss``, ``count_targets`` and ``target_axes`` of a model stage (see the module doc)."""

    @property
    def target_axes(self) -> tuple[str, ...]:
        """Mesh axes this rank's targets are one block of: dp, sp and the batch axes of the
        head's output (last stage only)."""
        return ("dp", "sp") + tuple(getattr(self.target_placement, "batch_axes", ()))

    def count_targets(self, target=None, ignore_index: int = -100, *, labels=None) -> torch.Tensor:
        """Real targets (``!= ignore_index``) of the whole global batch, int64 on every rank:
        ``target`` is this rank's block (``shard_target``) of the step's batch, or a list of its
        micro-batches; or ``labels=``: this replica's full labels [B, S] (or a list of them) as
        :meth:`loss` takes them. One all-reduce over :attr:`target_axes`; pass it as
        ``num_targets``."""
        self._require_head("count_targets")
        if labels is not None:
            blocks = [labels] if torch.is_tensor(labels) else list(labels)
            target = [self.target_from_labels(b, ignore_index) for b in blocks]
        elif target is None:
            raise ValueError("count_targets needs this rank's targets (shard_target) or labels=, the replica's full "
                             "labels")
        return batch_loss.count_targets(target, self.mesh, self.target_axes, ignore_index)

    def target_from_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """This rank's targets from this replica's full transformers-style ``labels`` ([B, S];
        [B] for classifiers): causal LMs shift them first (``batch_loss.shift_labels``: position
        t predicts token t+1, the last position ignored), then :meth:`shard_target` splits them
        like the logits, so under sp a chunk's last position gets the next chunk's first label."""
        if self.causal:
            labels = batch_loss.shift_labels(labels, ignore_index)
        return self.shard_target(labels)

    def per_target_loss(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        label_smoothing: float) -> torch.Tensor:
        """This rank's per-target cross entropy, shaped like ``target`` (0 where ignored)."""
        return self.get_submodule(self.head_name).loss(logits, target, ignore_index=ignore_index,
                                                       label_smoothing=label_smoothing, reduction="none")

    def loss(self, logits: torch.Tensor, target: torch.Tensor | None = None, *, labels: torch.Tensor | None = None,
             num_targets=None, ignore_index: int = -100, label_smoothing: float = 0.0,
             reduction: str = "mean") -> torch.Tensor:
        """Cross entropy of the global batch (``F.cross_entropy`` semantics), the same value on
        every rank: "mean" is the sum over every rank's real targets divided by their global
        count (``num_targets``: the whole step's count when the step runs in micro-batches,
        see :meth:`count_targets`; default: this call's, in the same all-reduce as the sum);
        "sum" the global sum; "none" this rank's per-target losses. The gradient is scaled so
        that averaging it over dp x sp (DDP, ``average_grads``) gives that of the global loss.

        logits: this stage's output. Give the targets one of two ways:
          target: this rank's block of targets as they are (``shard_target``; ids, -100
            ignored): position t is scored against ``target[t]``, nothing is shifted.
          labels: this replica's full labels [B, S] ([B] for ViT), as transformers' ``labels=``:
            causal LMs (GPT-2, OPT) shift them (position t predicts ``labels[t + 1]``, the last
            position ignored) before sharding, BERT and ViT use them as they are, so the loss
            equals transformers' ``labels=`` loss (see :meth:`target_from_labels`)."""
        self._require_head("loss")
        if (target is None) == (labels is None):
            raise ValueError("loss: pass either target (this rank's shard_target block, used as is) or labels= (this "
                             "replica's full [B, S] labels, shifted as transformers' labels= for causal LMs), not "
                             f"{'both' if labels is not None else 'neither'}")
        if labels is not None:
            target = self.target_from_labels(labels, ignore_index)
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"loss: reduction={reduction!r} is not one of 'mean', 'sum', 'none'")
        losses = self.per_target_loss(logits, target, ignore_index, label_smoothing)
        if reduction == "none":
            return losses
        return batch_loss.reduce_loss(losses, target != ignore_index, mesh=self.mesh, axes=self.target_axes,
                                      reduction=reduction, num_targets=num_targets)

    def _require_head(self, what: str) -> None:
        if self.head_name is None or not self.is_last:
            raise ValueError(f"this {type(self).__name__} stage has no head (it returns hidden states), so it has no "
                             f"{what}; call {what} on the last stage of a model built with its head")
