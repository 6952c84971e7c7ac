"""``shardzoo.pipeline(model, mesh, n_microbatches=4, schedule="1f1b")``: run a model that
``parallelize`` cut into pipeline stages (pipeline_cut.py) under a ``torch.distributed.pipelining``
schedule; ``pipe.step(input_ids=..., attention_mask=..., labels=...)`` is one training step.

Each stage this rank holds is a :class:`StageView`: a module whose forward calls the model
itself (its hooks split the inputs; its own code runs), the first stage with ``input_ids``, a
later one with the activation it received as ``inputs_embeds`` (the ids go along only to size
the batch); a model of one's own, whose forward takes ids only, gets that activation from its
token embedding's place (``pipeline_cut.Received``). Under Megatron sequence parallelism the
stages send this tp rank's chunk of the sequence: the model's code runs on a stand-in of the
whole shape, which the stage's first block exchanges for the chunk received, and the last
block's chunk is the stage's output (megatron_sp.py). The padding mask and position ids travel
to every stage as keyword arguments, which torch's schedules split into micro-batches for every
stage alike. The view holds the stage's modules as its submodules, so torch's stage sees that
stage's parameters only (the zero-bubble schedules split each backward by them), and a ZeRO 0 /
1 model gets one DDP engine per view, which torch's stages drive (no reduction until the last
micro-batch). Experts split over ep stay out of that DDP and are averaged over edp once per
step, after the schedule (pipeline_grads.py); a MoE model's load-balancing loss is refused.

The loss of a micro-batch is its share of the step's global token mean: the step counts the real
targets of the whole step first (labels shifted over the whole sequence, summed over dp), every
micro-batch's loss divides by that count, and the schedules run with ``scale_grads=False``
(docs/design.md, "The training loss is the global token mean"). The step's loss is broadcast
from the last stage to every rank of the pp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.comm.mesh import default_device
from shardzoo.layers import batch_loss
from shardzoo.layers.grad_fns import contiguous_grad
from shardzoo.parallel import inputs, megatron_sp, pipeline_cut
from shardzoo.parallel.data_parallel import info_of
from shardzoo.parallel.pipeline_grads import (average_experts, average_over_dp, experts_of, fsdp_hold, fsdp_reduce,
                                              sum_tied_grad, tied_group)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
_SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")  # input and weight gradients computed apart
_MULTI = {"interleaved_1f1b": "loop", "zero_bubble": "loop", "zbv": "v", "dualpipev": "v"}


def _schedule_class(name: str):
    from torch.distributed import pipelining as pl

    return {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
            "zero_bubble": pl.ScheduleInterleavedZeroBubble, "zbv": pl.ScheduleZBVZeroBubble,
            "dualpipev": pl.schedules.ScheduleDualPipeV}[name]


class StageView(nn.Module):
    """One pipeline stage of a cut model: ``forward(x, input_ids=None, attention_mask=None,
    position_ids=None)`` with ``x`` this dp replica's ids [b, S] on the first stage or the
    previous stage's output on a later one; returns this rank's logits block on the last stage,
    its block of the hidden states otherwise: [b, s, h], or under Megatron sequence parallelism
    this tp rank's chunk of the sequence [b, ceil(s / tp), h] (megatron_sp.py)."""

    def __init__(self, model: nn.Module, cut: pipeline_cut.StageCut, stage: int):
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == cut.n_stages - 1
        self.__dict__["model"] = model  # not a submodule: the view's parameters are its stage's only
        self.__dict__["cut"] = cut
        self.sp = model.__dict__["_shardzoo_parallel"].mesh.sp_size
        held = [f"{cut.blocks}.{i}" for i in cut.bounds(stage)]
        held += cut.before if self.first else []
        held += cut.after if self.last else []
        self.held = nn.ModuleDict({name.replace(".", "/"): model.get_submodule(name) for name in held})

    def forward(self, x, input_ids=None, attention_mask=None, position_ids=None):
        cut = self.__dict__["cut"]
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids}
        if not self.first:
            x = contiguous_grad(x)
            if cut.chunked:  # the model's code runs on a stand-in; the first block takes the chunk
                cut.chunk_in, x = x, self._stand_in(x, input_ids)
        if self.first:
            kwargs["input_ids"] = x
        elif cut.through_embedding:  # a model of one's own: its token embedding's place returns x
            kwargs["input_ids"] = input_ids
            cut.incoming = x
        else:
            kwargs.update(input_ids=input_ids, inputs_embeds=x)
        cut.active = self.stage if len(cut.held) > 1 else None
        cut.sending = cut.chunked and not self.last
        try:
            out = self.__dict__["model"](**{k: v for k, v in kwargs.items() if v is not None})
            if cut.sending:
                out = cut.chunk_out
        finally:
            cut.active, cut.incoming, cut.chunk_in, cut.sending, cut.chunk_out = None, None, None, False, None
        out = out.logits if hasattr(out, "logits") else out
        out = out.contiguous()  # torch's stage receives into buffers of these strides
        # a view (an identity placeholder's, a sliced head input) cannot be detached in place,
        # which the zero-bubble schedules do to free a stage's output
        return out.clone() if out._base is not None else out

    def _stand_in(self, chunk: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Zeros of the activation's whole shape [b, s, h] (s: this sp rank's share of the
        sequence), expanded from one element: what the model's code before the blocks reads
        (shapes, dtype) in place of the chunk."""
        return chunk.detach().new_zeros(()).expand(chunk.shape[0], input_ids.shape[-1] // self.sp, chunk.shape[-1])


def refuse_router_logits(model: nn.Module) -> None:
    """A MoE model whose config asks for its load-balancing loss is refused (docs/design.md,
    "Pipelines carry Megatron's sequence chunks, and MoE models without the aux loss")."""
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(f"{type(model).__name__} has config.output_router_logits=True, but a pipeline's loss is the "
                         f"cross entropy alone: the load-balancing loss multiplies two means over the tokens of "
                         f"every MoE layer and every row of the batch, so it splits neither into the stages (each "
                         f"holds some layers) nor into the micro-batches (1F1B runs a backward before the last "
                         f"forward); set model.config.output_router_logits = False to train without it, or use pp=1")


def check_step(input_ids: torch.Tensor, labels, n_microbatches: int) -> int:
    """This replica's batch rows, checked against a pipeline step's rules: ``n_microbatches``
    divides them and there are labels."""
    rows = input_ids.shape[0]
    if rows % n_microbatches:
        raise ValueError(f"n_microbatches={n_microbatches} does not divide this replica's batch of {rows} rows; pass a "
                         f"batch of a multiple of {n_microbatches} rows, or another n_microbatches")
    if labels is None:
        raise ValueError("pipe.step needs labels=[batch, seq] (the step is forward and backward of the loss)")
    return rows


def step_loss(losses: list[torch.Tensor], mesh, last_pp_rank: int) -> torch.Tensor:
    """The step's loss on every rank: the sum of the last stage's micro-batch losses (each its
    share of the step's mean), broadcast from that stage over the pp group."""
    device = default_device(mesh)
    loss = torch.stack([x.detach().float() for x in losses]).sum().to(device) if losses else \
        torch.zeros((), device=device)
    dist.broadcast(loss, src=dist.get_global_rank(mesh.pp_group, last_pp_rank), group=mesh.pp_group)
    return loss


class Pipeline:
    """A cut model under a torch pipeline schedule (module doc); made by :func:`pipeline`."""

    def __init__(self, model: nn.Module, mesh, n_microbatches: int, schedule: str):
        from torch.distributed.pipelining import PipelineStage

        self.model, self.mesh, self.n_microbatches, self.schedule_name = model, mesh, n_microbatches, schedule
        self.cut = pipeline_cut.cut_of(model)
        self.state = model.__dict__["_shardzoo_parallel"]
        self.views = [StageView(model, self.cut, s) for s in self.cut.held]
        shards = megatron_sp.shards_of(model)
        if shards is not None and schedule in _SPLIT_BACKWARD:
            shards.partial_grads.merged = False  # weight gradients computed group by group (partial_grads.py)
        info = info_of(model)
        # what torch's stage calls for each view: the view, or its DDP engine (zero 0 / 1). Under a
        # split backward DDP's reducer misses the weight pass, so the step averages over dp itself.
        # FSDP2 (zero 2 / 3) accumulates whole gradients over the micro-batches and reduce-scatters
        # them once, after the schedule (as DDP reduces once, in the last micro-batch)
        sharded = info is not None and not info.noop
        self.split = schedule in _SPLIT_BACKWARD
        self.average_after = info if sharded and self.split and info.zero <= 1 else None
        self.fsdp_after = model if sharded and info.zero >= 2 else None
        self.engines = [view if self.average_after else _ddp(view, info) for view in self.views]
        # experts split over ep that FSDP2 does not reduce: averaged over edp once, after the schedule
        self.experts = [m for m in experts_of(self.views) if not m.reduced_by_fsdp]
        for module in self.experts:
            module.reduced_per_step = True
        device = default_device(mesh)
        stages = [PipelineStage(engine, view.stage, self.cut.n_stages, device, group=mesh.pp_group)
                  for engine, view in zip(self.engines, self.views)]
        cls = _schedule_class(schedule)
        held = stages if schedule in _MULTI else stages[0]
        self.schedule = cls(held, n_microbatches, loss_fn=self._loss, scale_grads=False)
        self.num_targets = None
        self.last_pp_rank = self.cut.rank_of(self.cut.n_stages - 1)
        self.tied_group = None
        if self.cut.tied and not _same_rank_ends(self.cut):  # collective: every rank builds the groups
            self.tied_group = tied_group(mesh)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        state = self.state
        local = state.shard(target, state.target_placement, fill=-100)
        return inputs.local_loss(state, self.model, logits.float(), local, num_targets=self.num_targets)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of this dp replica's whole batch ([B, S] each, the same on every
        rank of the replica) in ``n_microbatches`` micro-batches. Returns the step's loss, the
        global token mean over dp x sp (the serial ``out.loss`` of the whole batch), on every
        rank; the gradients are left in the parameters, as after ``loss.backward()``."""
        refuse_router_logits(self.model)
        rows = check_step(input_ids, labels, self.n_microbatches)
        if position_ids is not None and position_ids.shape[0] != rows:
            position_ids = position_ids.expand(rows, -1)  # one row for all: torch splits every kwarg by rows
        target = batch_loss.shift_labels(labels) if self.state.causal else labels
        self.num_targets = inputs.count_real_targets(self.state, [labels])
        kwargs = {k: v for k, v in {"input_ids": input_ids, "attention_mask": attention_mask,
                                     "position_ids": position_ids}.items() if v is not None}
        args = (input_ids,) if self.cut.holds_first else ()
        losses: list[torch.Tensor] = []
        resharding = fsdp_hold(self.fsdp_after, gathered=self.split) if self.fsdp_after is not None else None
        self.schedule.step(*args, target=target if self.cut.holds_last else None, losses=losses,
                           return_outputs=False, **kwargs)
        if self.fsdp_after is not None:
            fsdp_reduce(self.fsdp_after, resharding)
        self._sync_tied()
        if self.average_after is not None:
            average_over_dp(self.views, self.average_after)
        average_experts(self.experts, self.mesh)
        return step_loss(losses, self.mesh, self.last_pp_rank)

    def _sync_tied(self) -> None:
        """Sum the gradients of the token table (first stage) and its untied copy, the head (last)."""
        if self.tied_group is None:
            return
        model = self.model
        table = model.get_input_embeddings() if self.cut.holds_first else model.get_output_embeddings()
        sum_tied_grad(getattr(table, "weight", None), self.mesh)


def _same_rank_ends(cut: pipeline_cut.StageCut) -> bool:
    return cut.rank_of(0) == cut.rank_of(cut.n_stages - 1)


def _ddp(view: StageView, info):
    """The engine torch's stage drives for ``view``: a DDP over the dp group for zero 0 / 1,
    the experts split over ep left out (they differ over dp; the step averages them over edp)."""
    if info is None or info.noop or info.zero >= 2:
        return view
    from torch.nn.parallel import DistributedDataParallel

    experts = {id(p) for m in experts_of([view]) for p in m.parameters()}
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            view, [n for n, p in view.named_parameters() if id(p) in experts])
    return DistributedDataParallel(view, process_group=info.group, find_unused_parameters=True)


def pipeline(model: nn.Module, mesh, *, n_microbatches: int = 4, schedule: str = "1f1b") -> Pipeline:
    """Run ``model``, cut by ``shardzoo.parallelize`` on a mesh with pp > 1 (and optionally
    passed through ``shardzoo.data_parallel``), as a pipeline.

    Args:
        model: the parallelized model (this rank's stage(s)).
        mesh: the ParallelMesh it was parallelized on.
        n_microbatches: micro-batches per step; must divide this dp replica's batch.
        schedule: "gpipe", "1f1b", "interleaved_1f1b" (``virtual_stages >= 2``), "zero_bubble"
            (torch's ScheduleInterleavedZeroBubble, ``virtual_stages >= 2``), "zbv"
            (ScheduleZBVZeroBubble) or "dualpipev" (both ``virtual_stages=2``, ``placement="v"``).

    Returns a :class:`Pipeline`; ``pipe.step(input_ids=[B, S], attention_mask=[B, S],
    labels=[B, S])`` on every rank runs one step and returns its loss. Collective over the mesh."""
    cut = pipeline_cut.cut_of(model)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if cut is None:
        raise ValueError(f"shardzoo.pipeline runs a model parallelize cut into stages; {type(model).__name__} was not "
                         f"(parallelize it on a mesh with pp > 1, got pp={mesh.pp_size})")
    refuse_router_logits(model)
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches!r} must be an int >= 1")
    if n_microbatches < mesh.pp_size:
        raise ValueError(f"n_microbatches={n_microbatches} is fewer than the pp={mesh.pp_size} stages; torch's schedules "
                         f"need at least one micro-batch per stage: pass n_microbatches >= {mesh.pp_size} (and a "
                         f"batch of at least that many rows per dp replica)")
    per_rank = len(cut.held)
    if schedule in ("gpipe", "1f1b") and per_rank != 1:
        raise ValueError(f"schedule={schedule!r} runs one stage per rank; the model was cut with virtual_stages="
                         f"{per_rank}: use 'interleaved_1f1b' or 'zero_bubble', or parallelize with virtual_stages=1")
    want = _MULTI.get(schedule)
    if want == "loop" and (per_rank < 2 or cut.placement != "loop"):
        raise ValueError(f"schedule={schedule!r} needs >= 2 stages per rank in loop placement; the model was cut with "
                         f"virtual_stages={per_rank}, placement={cut.placement!r}: parallelize with virtual_stages=2")
    if want == "v" and cut.placement != "v":
        raise ValueError(f"schedule={schedule!r} needs the V placement; parallelize with virtual_stages=2, "
                         f"placement='v'")
    return Pipeline(model, mesh, n_microbatches, schedule)
