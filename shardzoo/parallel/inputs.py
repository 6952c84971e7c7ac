"""Entering and leaving a parallelized model: its inputs, its loss and its logits.

``model(input_ids=[B, S], attention_mask=[B, S], position_ids=..., labels=[B, S])`` takes the
full tensors of this dp replica on every tp and sp rank. A forward pre-hook (torch's own
extension point; the model's forward is not touched) splits them:

* a batch the layout's batch parts do not divide (a batch of 1 or 3 on a 2 x 2 grid) is padded
  up to the next multiple by repeating its last row, with labels -100: the padded rows are
  outside the loss, and :func:`gather_logits` trims them (a model without an 'lm_head', whose
  outputs shardzoo does not gather, is refused such a batch);
* ``input_ids``: along the batch axes of the layout's activations, then along sp (zigzag for
  causal models, so every sp rank does equal attention work); a floating-point 4-d first
  input (pixels [B, C, H, W]) along the batch axes only: its 'patch_embedding' makes the
  sequence and splits it;
* ``attention_mask`` and per-row ``position_ids``: along the batch axes of the attention's
  activations (the 3D layout swaps them inside a block); under sp the padding mask goes to
  shardzoo's attention (hf_attention.py, sdpa_mode.py) and the model gets none;
* ``position_ids`` under sp: the global positions of this rank's tokens, so RoPE and learned
  positions see where each token really is;
* ``labels`` (transformers models): shifted over the whole sequence first when the model is
  a causal LM, as transformers' loss does, then split like the logits;
* packed documents (transformers' format: batch 1, ``position_ids`` restarting at 0 for each
  document, as ``DataCollatorWithFlattening`` makes them) under sp: every sequence tensor is
  split by the balanced per-document split of ``shard_sequence(..., cu_seqlens=...)``, and the
  attention keeps each document to itself (hf_attention.py).

The loss is the global token mean over dp, sp and the batch axes (layers/batch_loss.py), the
same value on every rank.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from shardzoo.layers import batch_loss, replicas
from shardzoo.layers.grad_fns import scale_grad
from shardzoo.layers.packing import cu_seqlens_from_position_ids
from shardzoo.layers.sequence import gather_sequence, shard_positions, shard_sequence
from shardzoo.layers.shard_spec import unwrap_ddp
from shardzoo.layers.tensor_layout import layout_of


class Parallelized:
    """What ``parallelize`` recorded on a model: mesh, sp mode, whether it is causal, the
    qualified names of its head and token table, the batch placements of its inputs, and the
    current forward's padding mask for the sequence-parallel attention."""

    def __init__(self, model: nn.Module, mesh, sp_mode: str, hf: bool, causal: bool, head: str | None,
                 embedding: str | None):
        self.mesh, self.sp_mode, self.hf, self.causal = mesh, sp_mode, hf, causal
        self.head, self.embedding = head, embedding
        self.grads_averaged_over: tuple[str, ...] = ("sp",)  # by backward() itself (sp_grads.py)
        self.key_padding_mask: torch.Tensor | None = None
        self.cu_seqlens: torch.Tensor | None = None  # this forward's packed documents (sp > 1)
        self.num_targets = None  # this forward's num_targets= (the step's real targets), for the loss
        self.check_inputs = "first"  # compare the tp / sp ranks' inputs: "first" forward, "every" forward, "never"
        self.inputs_checked = False
        # under sp, the model's forward gets this replica's whole-sequence padding mask (rows of
        # its batch, padded rows 0) and its base model none: a MoE causal LM's load-balancing
        # loss reads it beside the router logits gathered over sp (parallel/router_logits.py)
        self.whole_mask_to_model = False
        layout = layout_of(mesh)
        self.input_placement = layout.activation
        self.mask_placement = layout.linear_output(layout.activation)  # the attention's batch rows
        self.target_placement = layout.activation
        self.rows: int | None = None  # this forward's batch rows, before padding
        self.padded_rows: int | None = None  # ... after: a multiple of the batch parts

    @property
    def zigzag(self) -> bool:
        return self.causal and self.mesh.sp_size > 1

    def batch_parts(self) -> int:
        """How many blocks the batch is cut into (the same for inputs, masks and targets)."""
        return math.lcm(*(placement.batch_parts(self.mesh)
                          for placement in (self.input_placement, self.mask_placement, self.target_placement)))

    def start_batch(self, rows: int, model: nn.Module) -> None:
        """Record this forward's batch of ``rows`` and the rows it is padded to; refuse it where
        the padding could not be trimmed (no 'lm_head')."""
        parts = self.batch_parts()
        self.rows, self.padded_rows = rows, -(-rows // parts) * parts
        if self.padded_rows != rows and self.head is None:
            axes = "*".join(f"{a}={self.mesh.size(a)}" for a in self.input_placement.batch_axes)
            raise ValueError(f"a batch of {rows} rows does not split over the {self.mesh.tp_mode} layout's {parts} "
                             f"batch parts ({axes}), and {type(model).__name__} has no 'lm_head' whose loss and "
                             f"gathered logits shardzoo pads and trims; pass a batch of a multiple of {parts} rows "
                             f"(e.g. {self.padded_rows})")

    def pad(self, t: torch.Tensor, fill=None) -> torch.Tensor:
        """[rows, ...] -> [padded_rows, ...]: the last row repeated (valid ids, masks and
        positions), or ``fill`` (labels: the ignore index); other tensors unchanged."""
        if self.rows is None or self.padded_rows == self.rows or t.shape[0] != self.rows:
            return t
        extra = (self.padded_rows - self.rows, *t.shape[1:])
        return torch.cat([t, t[-1:].expand(extra) if fill is None else t.new_full(extra, fill)])

    def trim(self, t: torch.Tensor) -> torch.Tensor:
        """A gathered [padded_rows, ...] output -> this forward's [rows, ...]."""
        return t[:self.rows] if self.rows is not None and t.shape[0] == self.padded_rows else t

    def shard_rows(self, t: torch.Tensor, placement, fill=None) -> torch.Tensor:
        """[B, S, ...] -> this rank's [b, S, ...]: padded (:meth:`pad`), then the batch rows of
        ``placement`` (None, or one row broadcast over a larger batch: kept whole)."""
        if placement is not None:
            t = self.pad(t, fill)
        if placement is not None and t.shape[0] != 1:
            t = layout_of(self.mesh).shard_batch(t, placement)
        return t

    def shard(self, t: torch.Tensor, placement, fill=None) -> torch.Tensor:
        """[B, S, ...] -> this rank's [b, s, ...]: :meth:`shard_rows`, then the sp shard."""
        t = self.shard_rows(t, placement, fill)
        if self.mesh.sp_size > 1:
            t = shard_sequence(t, self.mesh.sp_group, 1, zigzag=self.zigzag, cu_seqlens=self.cu_seqlens)
        return t

    def __repr__(self) -> str:
        return f"Parallelized(mesh={self.mesh!r}, sp_mode={self.sp_mode!r}, causal={self.causal}, head={self.head!r})"


def install(model: nn.Module, state: Parallelized) -> None:
    """Register the input-splitting pre-hook and record the head's output placement."""
    if state.head is not None:
        state.target_placement = layout_of(state.mesh).after(model.get_submodule(state.head))
        if not hasattr(model, "count_targets"):  # model.count_targets(labels): the step's count
            model.count_targets = functools.partial(count_targets, model)
    model.register_forward_pre_hook(lambda m, a, k: _split_inputs(state, m, a, k), with_kwargs=True)


def _split_inputs(state: Parallelized, model: nn.Module, args: tuple, kwargs: dict):
    args, kwargs = list(args), dict(kwargs)
    state.num_targets = kwargs.pop("num_targets", None) if state.hf else None  # for the loss (hf_model.py)
    _check_same_inputs(state, args, kwargs)
    seq = None
    state.cu_seqlens = _packed_documents(state, kwargs.get("position_ids"), kwargs.get("attention_mask"))
    first = kwargs.get("input_ids")
    first = args[0] if first is None and args and torch.is_tensor(args[0]) else first
    state.rows = state.padded_rows = None
    if first is not None and first.dim() >= 1:
        state.start_batch(first.shape[0], model)
    if kwargs.get("input_ids") is not None and kwargs.get("inputs_embeds") is not None:
        # a pipeline stage after the first: its input is this rank's activation from the stage
        # before (pipelined.py); the ids only size the batch and the sequence
        seq = kwargs.pop("input_ids").shape[-1]
    elif kwargs.get("input_ids") is not None:
        seq = kwargs["input_ids"].shape[-1]
        kwargs["input_ids"] = _ids(state, kwargs["input_ids"])
    elif args and torch.is_tensor(args[0]):
        seq = args[0].shape[-1]
        args[0] = _ids(state, args[0])
    mask = kwargs.get("attention_mask")
    state.key_padding_mask = None
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(f"a parallelized model takes a [batch, seq] padding mask (1 = attend); got attention_mask "
                             f"of shape {tuple(mask.shape)}. Pass the 2-d mask; the model builds the rest")
        local = state.shard(mask, state.mask_placement)
        state.key_padding_mask = local.bool()
        kwargs["attention_mask"] = None if state.mesh.sp_size > 1 else local
        if state.mesh.sp_size > 1 and state.whole_mask_to_model:
            kwargs["attention_mask"] = state.shard_rows(mask, state.mask_placement, fill=0)
    positions = kwargs.get("position_ids")
    if positions is not None:
        kwargs["position_ids"] = state.shard(positions, state.mask_placement)
    elif state.hf and state.mesh.sp_size > 1 and seq is not None:
        local = shard_positions(seq // state.mesh.sp_size, state.mesh.sp_rank, state.mesh.sp_size, state.zigzag)
        kwargs["position_ids"] = local[None].to(_device(args, kwargs))
    if state.hf and kwargs.get("labels") is not None:
        kwargs["labels"] = shard_labels(state, kwargs["labels"])
    if state.hf and "use_cache" not in kwargs:
        kwargs["use_cache"] = False  # a cache of sharded keys is no cache of the sequence
    return tuple(args), kwargs


CHECK_INPUTS = ("first", "every", "never")
_CHECKED = ("input_ids", "attention_mask", "labels", "position_ids")


def _check_same_inputs(state: Parallelized, args: list, kwargs: dict) -> None:
    """Every tp and sp rank of this dp replica must be given the same full batch: on the first
    forward (``check_inputs="every"`` or ``SHARDZOO_DEBUG=1``: on every one), one checksum per
    input (ids, mask, labels, positions) compared over the tp and sp axes (one small int64
    all-reduce per axis of size > 1). Ranks of a tp group fed different rows otherwise train on
    a mix of them with no error (the embedding's and the loss's all-reduces mix the ranks'
    inputs into the same replicated values, so even checkpoint.save's replica check passes)."""
    every = state.check_inputs == "every" or replicas.debug_mode()
    if state.check_inputs == "never" or (state.inputs_checked and not every):
        return
    mesh = state.mesh
    if mesh.size("sp", "tp") == 1:
        return
    tensors = [kwargs.get(name) for name in _CHECKED] + [args[0] if args and torch.is_tensor(args[0]) else None]
    device = next((t.device for t in tensors if torch.is_tensor(t)), None)
    sums = torch.stack([replicas.checksum(t) if torch.is_tensor(t) else torch.zeros((), dtype=torch.int64, device=device)
                        for t in tensors]) if device is not None else torch.zeros(1, dtype=torch.int64)
    replicas.check_same_input(sums, mesh, who="the parallelized model's forward (input_ids, attention_mask, labels, "
                                              "position_ids; checked on the first forward, or on every one with "
                                              "parallelize(..., check_inputs='every'))",
                              fix="pass it whole: the model splits it over tp and sp itself")
    state.inputs_checked = True


def _packed_documents(state: Parallelized, positions, mask) -> torch.Tensor | None:
    """cu_seqlens of a packed batch (batch 1, positions restarting at 0) under sp, else None."""
    if not (state.hf and state.mesh.sp_size > 1 and torch.is_tensor(positions) and positions.dim() == 2
            and positions.shape[0] == 1 and bool((positions[0, 1:] == 0).any())):
        return None
    if mask is not None:
        raise ValueError("a packed batch (position_ids restarting at 0 for each document) needs no attention_mask: "
                         "the documents are its boundaries; pass attention_mask=None")
    return cu_seqlens_from_position_ids(positions)


def _ids(state: Parallelized, ids: torch.Tensor) -> torch.Tensor:
    if torch.is_floating_point(ids) and ids.dim() == 4:  # pixels [B, C, H, W]: the embedding makes the sequence
        return layout_of(state.mesh).shard_batch(state.pad(ids), state.input_placement)
    if torch.is_floating_point(ids) and ids.dim() == 3:  # activations [B, S, H]
        return shard_activations(state, ids)
    if ids.dim() != 2:
        raise ValueError(f"a parallelized model takes input_ids [batch, seq] of this dp replica, pixels [batch, "
                         f"channels, height, width] or float activations [batch, seq, hidden]; got shape "
                         f"{tuple(ids.shape)} ({ids.dtype})")
    return state.shard(ids, state.input_placement)




def shard_activations(state: Parallelized, x: torch.Tensor) -> torch.Tensor:
    """Full float activations [B, S, H] of this dp replica -> this rank's block of the layout's
    activations (batch rows and hidden block of the tp layout, then the sp shard, zigzag for a
    causal model). Differentiable: ``x``'s gradient is the full one on every rank.

    :func:`gather_output` hands the gradient back sp times larger (the convention of the loss,
    whose sp ranks' shares ``backward()`` averages, sp_grads.py); it is divided here again."""
    layout = layout_of(state.mesh)
    x = layout.shard_hidden(x, state.input_placement)
    if state.mesh.sp_size > 1:
        x = shard_sequence(scale_grad(x, 1.0 / state.mesh.sp_size), state.mesh.sp_group, 1,
                           zigzag=state.zigzag)
    return x


def _device(args, kwargs):
    for t in list(kwargs.values()) + list(args):
        if torch.is_tensor(t):
            return t.device
    return None


def shard_labels(state: Parallelized, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Full labels [B, S] -> this rank's targets, laid out like its logits: shifted first for a
    causal LM (position t predicts token t + 1, the last position ignored)."""
    if state.causal:
        labels = batch_loss.shift_labels(labels, ignore_index)
    return state.shard(labels, state.target_placement, fill=ignore_index)


def local_loss(state: Parallelized, model: nn.Module, logits: torch.Tensor, target: torch.Tensor, *,
               ignore_index: int = -100, num_targets=None) -> torch.Tensor:
    """Global token-mean cross entropy of vocab-parallel ``logits`` [b, s, V_l] against this
    rank's ``target`` [b, s] (already split by :func:`shard_labels`)."""
    head = model.get_submodule(state.head)
    losses = head.loss(logits, target, ignore_index=ignore_index, reduction="none")
    axes = ("dp", "sp") + tuple(state.target_placement.batch_axes)
    return batch_loss.reduce_loss(losses, target != ignore_index, mesh=state.mesh, axes=axes,
                                  num_targets=num_targets)


def _state(model: nn.Module) -> tuple[Parallelized, nn.Module]:
    model = unwrap_ddp(model)
    state = model.__dict__.get("_shardzoo_parallel")
    if state is None:
        raise ValueError(f"{type(model).__name__} was not made by shardzoo.parallelize; pass the parallelized model")
    if state.head is None:
        raise ValueError(f"{type(model).__name__}'s plan has no 'lm_head', so it has no vocabulary-parallel logits")
    return state, model


def lm_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
            num_targets=None) -> torch.Tensor:
    """Cross entropy of a parallelized model's local ``logits`` [b, s, V_l] against the full
    ``labels`` [B, S] of this dp replica (shifted for a causal model, as transformers'
    ``labels=``): the global token mean, the same on every rank (for a model of one's own,
    whose forward has no transformers loss)."""
    state, model = _state(model)
    target = shard_labels(state, labels, ignore_index)
    return local_loss(state, model, logits, target, ignore_index=ignore_index, num_targets=num_targets)


def count_targets(model: nn.Module, labels, ignore_index: int = -100) -> torch.Tensor:
    """Real targets of the whole step, int64, the same on every rank: ``labels`` is this dp
    replica's full labels [B, S] (as ``labels=`` takes them), or the list of the step's
    micro-batches' labels; shifted first for a causal LM, as the loss scores them. One
    all-reduce over dp. Pass it as ``num_targets=`` to every micro-batch's forward (or
    ``lm_loss``), so their losses are shares of the step's mean and the gradients add up."""
    state, model = _state(model)
    blocks = [labels] if torch.is_tensor(labels) else list(labels)
    if not blocks or any(b.dim() != 2 for b in blocks):
        raise ValueError(f"count_targets takes this dp replica's full labels [batch, seq], or a list of the step's "
                         f"micro-batches' labels; got {[tuple(b.shape) for b in blocks] or 'an empty list'}")
    return count_real_targets(state, blocks, ignore_index)


def count_real_targets(state: Parallelized, blocks: list[torch.Tensor], ignore_index: int = -100) -> torch.Tensor:
    """The real targets of this dp replica's full labels ``blocks`` (shifted first for a causal
    LM), summed over dp: int64, the same on every rank (any stage of a pipeline)."""
    if state.causal:
        blocks = [batch_loss.shift_labels(b, ignore_index) for b in blocks]
    local = sum((b != ignore_index).sum() for b in blocks).to(torch.int64).reshape(1)
    if state.mesh.device_mesh.device_type == "cuda":  # NCCL reduces CUDA tensors only
        local = local.cuda()
    return batch_loss.sum_over_axes(local, state.mesh, ("dp",)).reshape(())


def gather_output(model: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A parallelized model's local output block ``y`` in the layout's activations [b, s, h]
    (the block its float input [B, S, H] became, as a stack of blocks returns it) -> the full
    [B, S, H] of this dp replica, on every rank (collective over tp and sp; differentiable).

    A loss computed from the result on every rank backpropagates into this rank's block only;
    under sp the gradient is handed back sp times larger, the convention of shardzoo's losses,
    so that ``backward()``'s average over sp (sp_grads.py) gives every parameter its serial
    gradient."""
    model = unwrap_ddp(model)
    state = model.__dict__.get("_shardzoo_parallel")
    if state is None:
        raise ValueError(f"{type(model).__name__} was not made by shardzoo.parallelize; pass the parallelized model")
    if y.dim() != 3:
        raise ValueError(f"gather_output takes the model's local [batch, seq, hidden] output; got shape "
                         f"{tuple(y.shape)}. For a model's logits use shardzoo.gather_logits")
    full = layout_of(state.mesh).gather_hidden(y, state.input_placement)
    if state.mesh.sp_size == 1:
        return full
    return gather_over_sp(state, full)


def gather_over_sp(state: Parallelized, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """This sp rank's [b, s, ...] (dim 1: its tokens of the sequence, as the input hook split
    them) -> the replica's [b, S, ...] on every sp rank (differentiable). Its gradient is handed
    back sp times larger, so that ``backward()``'s average over sp (sp_grads.py) gives every
    parameter its serial gradient from a loss every sp rank computes alike."""
    x = scale_grad(x, float(state.mesh.sp_size))
    return gather_sequence(x, state.mesh.sp_group, 1, zigzag=state.zigzag, cu_seqlens=cu_seqlens)


def gather_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """A parallelized model's local logits [b, s, V_l] -> the full [B, S, V] of this dp replica,
    on every rank (collective over tp and sp; differentiable); the rows a batch was padded
    with are dropped."""
    state, model = _state(model)
    full = model.get_submodule(state.head).gather_output(logits)
    full = gather_sequence(full, state.mesh.sp_group, 1, zigzag=state.zigzag, cu_seqlens=state.cu_seqlens)
    return state.trim(full)
