"""What every model shares as a (possibly partial) pipeline stage, and the glue to
``torch.distributed.pipelining``.

A stage holds a contiguous range of globally numbered blocks; the embeddings sit on the first
stage and the head on the last. A model built whole is a single stage holding everything.
``build_schedule`` wraps this rank's stage(s) in ``PipelineStage`` over ``mesh.pp_group`` and
returns a GPipe / 1F1B / interleaved 1F1B / zero-bubble (interleaved, ZB-V, DualPipeV) schedule; ``schedule.step(ids, target=...)`` on the
first / last stage runs one training step. The step counts the real targets of its whole batch
once and passes them to every microbatch's loss (``num_targets``), whose gradients are summed
(``scale_grads=False``): the gradients are those of the step's global token mean, as the
unpipelined model's, and the microbatch losses add up to that mean.

With tied input / output embeddings the last stage holds its own copy of the table
(``lm_head.weight``); :func:`sync_tied_grads` sums the two gradients between the first and the
last stage after backward, so both copies step identically (Megatron's embedding group).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardzoo.comm.mesh import default_device
from shardzoo.layers import replicas
from shardzoo.layers.shard_spec import ShardSpec, get_shard_spec
from shardzoo.layers.tensor_layout import layout_of
from shardzoo.layers.token_ids import check_token_ids
from shardzoo.models import common
from shardzoo.models.loss import GlobalLoss
from shardzoo.models.meta import materialize, seeded_normal_piece
from shardzoo.models.pretrained import config_from_dir, load_pretrained
from shardzoo.models.spec import spec_of
from shardzoo.parallel.data_parallel import ddp_of
from shardzoo.parallel.pipeline_grads import sum_tied_grad, tied_group
from shardzoo.parallel.pipelined import check_step, step_loss

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev")
_SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")  # input and weight gradients computed apart
_V_PLACED = ("zbv", "dualpipev")  # stages pp_rank and 2 pp - 1 - pp_rank on each rank


class StagedModel(GlobalLoss, nn.Module):
    """Base of the model families: token sharding, gathering, loss (models/loss.py), loading,
    the seeded init.

    Subclasses (models/planned.py ``PlannedModel``) set ``causal`` and, in ``__init__``:
    ``mesh``, ``placement`` (the activation placement of ``layout``, the mesh's TensorLayout),
    ``is_first``, ``is_last``, ``checkpointing`` and on the last stage the head's
    ``target_placement``."""

    causal = False
    head_name = "lm_head"
    tied_names: dict[str, str] = {"lm_head.weight": "transformer.wte.weight"}

    @classmethod
    def from_pretrained(cls, hf_dir: str, *, mesh, strict: bool = True, **kwargs):
        """The model built from ``hf_dir/config.json`` on ``mesh`` (any layout; ``stage=``,
        ``sp_mode=`` ... as the constructor) and filled from the Hugging Face weights there
        (``model.safetensors`` or a sharded index), each rank reading only its own slices.
        Collective: every rank calls it. See models/pretrained.py."""
        config = config_from_dir(spec_of(cls), hf_dir)
        kwargs = cls.pretrained_kwargs(hf_dir, kwargs)
        device = kwargs.pop("device", None) or "cpu"
        model = cls(config, mesh=mesh, device="meta", **kwargs)  # shapes only: no random init
        materialize(model, device)
        model.load_result = load_pretrained(model, hf_dir, strict=strict)
        missing = set(model.load_result.missing_keys)
        if missing:  # left out of the checkpoint: initialise as a fresh model would be
            model.init_weights(names=missing)
        return model

    @classmethod
    def pretrained_kwargs(cls, hf_dir: str, kwargs: dict) -> dict:
        """Constructor arguments for :meth:`from_pretrained` (a family may add defaults read
        from the checkpoint, e.g. whether BERT's MLM head is there)."""
        return kwargs

    @property
    def layout(self):
        """The mesh's :class:`~shardzoo.layers.tensor_layout.TensorLayout` (blocks, layouts)."""
        return layout_of(self.mesh)

    @property
    def mask_placement(self):
        """Batch placement of key padding masks: the attention's, i.e. its QKV projection's output."""
        return self.layout.linear_output(self.placement)

    def shard_input(self, ids_full: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] -> this rank's [b, s] (batch as the tp layout, sequence over sp).
        Every tp and sp rank of a dp replica must pass the same ``ids_full``; with
        ``SHARDZOO_DEBUG=1`` that is checked (layers/replicas.py: one small all-reduce per
        sp / tp axis, each call). Ids outside the vocabulary raise ``IndexError`` here, on every
        rank alike (each holds the full batch), before any collective could leave a rank waiting."""
        if replicas.debug_mode():
            replicas.check_same_input(ids_full, self.mesh, f"{type(self).__name__}.shard_input")
        check_token_ids(ids_full, self.config.vocab_size, type(self).__name__)
        return common.shard_tokens(ids_full, self.mesh, self.placement, zigzag=self.causal)

    def shard_mask(self, mask_full: torch.Tensor) -> torch.Tensor:
        """Key padding mask bool [B, S] (True = attend) -> this rank's [b, s]."""
        return common.shard_tokens(mask_full, self.mesh, self.mask_placement, zigzag=self.causal)

    def shard_target(self, target_full: torch.Tensor) -> torch.Tensor:
        """Targets [B, S] (or [B] for classifiers) -> this rank's rows of the head's output."""
        if target_full.dim() == 1:
            return self.layout.shard_batch(target_full, self.target_placement)
        return common.shard_tokens(target_full, self.mesh, self.target_placement, zigzag=self.causal)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """This stage's output -> the full tensor on every rank: logits [B, S, V] on the last
        stage (padding columns dropped), hidden states [B, S, H] on the others."""
        if self.is_last and self.head_name is not None:
            y = self.get_submodule(self.head_name).gather_output(y_local)
            if y.dim() == 2:  # pooled / classifier logits [B, C]: no sequence dim
                return y
            return common.gather_tokens(y, self.mesh, None, zigzag=self.causal)
        y = self.layout.gather_hidden(y_local, self.placement)
        return common.gather_tokens(y, self.mesh, None, zigzag=self.causal)

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
        """Load full-size shardzoo-named tensors (e.g. from ``hf_to_shardzoo``) into this stage;
        an untied copy of a tied table falls back to the table's entry."""
        state = dict(state)
        for copy, table in self.tied_names.items():
            if copy not in state and table in state:
                state[copy] = state[table]
        return common.load_full_state_dict(self, state, strict)

    def allocate(self, device=None, seed: int | None = None) -> None:
        """Give the meta-built model storage for this rank's shards only, on ``device``
        (default: torch's default device), and fill it with :meth:`init_weights` (``seed``;
        default ``torch.initial_seed()``, so ranks seeded alike build identical full weights).
        ``device="meta"`` leaves the model on meta (e.g. for :meth:`from_pretrained`).
        The family constructors end with this call (models/planned.py)."""
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "meta":
            return
        materialize(self, device)
        self.init_weights(torch.initial_seed() if seed is None else seed, std=self.init_std)

    @property
    def init_std(self) -> float:
        """Standard deviation of the random init (the config's ``initializer_range`` when set)."""
        return getattr(self.config, "initializer_range", 0.02)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02, names=None) -> None:
        """Hugging Face-style init, the same for every layout and stage split: each full
        tensor is determined by ``seed`` and the parameter's global name, and this rank draws
        only the rows its piece touches (``meta.seeded_normal_piece``). Matrices / tables ~
        N(0, std), biases 0, 1-D weights (LayerNorm) 1. ``names``: only these parameters
        (default all)."""
        for name, p in self.named_parameters():
            if names is not None and name not in names:
                continue
            spec = get_shard_spec(self, name) or ShardSpec(tuple(p.shape), (0,) * p.dim(), tuple(p.shape))
            key = self.tied_names.get(name, name)  # an untied copy of a tied table draws the table
            if name.endswith("bias") or len(spec.global_shape) == 1:
                piece = torch.zeros(spec.local_shape)
                piece[spec.valid_local()] = 0.0 if name.endswith("bias") else 1.0
            else:
                piece = seeded_normal_piece(seed, key, spec, std)
            p.copy_(piece)


def build_schedule(stages: list[tuple[int, nn.Module]], mesh, *, n_microbatches: int, schedule: str = "1f1b",
                   loss_fn=None, device=None):
    """A ``torch.distributed.pipelining`` schedule over ``mesh.pp_group`` for this rank's stages.

    ``stages``: (global stage index, stage module) pairs held by this rank; one pair for GPipe /
    1F1B, v pairs (indices ``pp_rank + i * pp``) for the interleaved schedule. A stage may be
    passed through ``shardzoo.data_parallel`` (any ZeRO stage): torch's schedules then average
    its gradients over dp x sp in the last microbatch's backward (DDP) or drive FSDP2's sync.
    ``loss_fn(output, target, **loss_kwargs)``: the loss on the last stage (e.g. ``model.loss``).
    Pass it on every rank: a schedule built without one skips backward on that rank (and the
    others wait). ``schedule.step(..., target=t, loss_kwargs=...)`` on the last stage counts
    the real targets of ``t`` (``model.count_targets``, with ``loss_kwargs``' ``ignore_index``)
    and passes ``num_targets`` to every microbatch's loss, unless ``loss_kwargs`` gives it or
    another reduction than "mean"; the microbatch losses (``losses=``) sum to the step's loss.
    Pass ``return_outputs=False`` to ``step`` unless the logits are needed: by default torch's
    last stage keeps every microbatch's output until the step ends (the whole local batch of
    logits), which the planner's memory model (docs/planner.md) does not count."""
    if loss_fn is None:
        raise ValueError("build_schedule needs loss_fn on every rank (the schedules run backward only when they have "
                         "one); pass the last stage's model.loss, or any callable on the other ranks")
    from torch.distributed import pipelining as pl

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    pp = mesh.pp_size
    device = device or default_device(mesh)  # where the stages' p2p buffers live (CUDA under NCCL)
    total = pp * len(stages)
    split = schedule in _SPLIT_BACKWARD
    # a zero 0 / 1 stage runs through its DDP engine, which torch's stages recognise (no_sync);
    # under a split backward DDP's reducer misses the weight pass: the model's own forward runs
    # and the step averages the gradients itself (``_split_step``)
    wrapped = [pl.PipelineStage(_engine(m, split), index, total, device, group=mesh.pp_group) for index, m in stages]
    last = [getattr(m, "module", m) for _, m in stages if getattr(getattr(m, "module", m), "is_last", False)]
    indices = [index for index, _ in stages]
    if schedule in ("interleaved", "zero_bubble"):
        if len(stages) < 2:
            raise ValueError(f"the {schedule} schedule needs >= 2 stages per rank (virtual stages); build the model as "
                             f"stages pp_rank + i * pp for i in range(v)")
        cls = pl.ScheduleInterleaved1F1B if schedule == "interleaved" else pl.ScheduleInterleavedZeroBubble
        held = wrapped
    elif schedule in _V_PLACED:
        want = [mesh.pp_rank, 2 * pp - 1 - mesh.pp_rank]
        if sorted(indices) != sorted(want):
            raise ValueError(f"schedule={schedule!r} runs two stages per rank in a V: stages {want} of {2 * pp} on pp "
                             f"rank {mesh.pp_rank}; got stages {indices}")
        cls = pl.ScheduleZBVZeroBubble if schedule == "zbv" else pl.schedules.ScheduleDualPipeV
        held = [w for _, w in sorted(zip(indices, wrapped), key=lambda t: t[0])]
    elif len(stages) != 1:
        raise ValueError(f"schedule={schedule!r} takes one stage per rank; got {len(stages)} (use 'interleaved')")
    else:
        cls, held = pl.ScheduleGPipe if schedule == "gpipe" else pl.Schedule1F1B, wrapped[0]
    # the loss of a microbatch is its share of the step's mean: gradients add up, unscaled
    result = _counting(cls)(held, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    result.count_targets = last[0].count_targets if last else None
    result.split_stages = [m for _, m in stages] if split else []
    return result


@contextlib.contextmanager
def _split_step(stages: list[nn.Module]):
    """Around a split-backward step of ``stages``: a ZeRO 2 / 3 stage (FSDP2, whose reduction
    torch's stage drives) keeps its parameters gathered through the step, and afterwards the
    zero 0 / 1 stages' gradients are averaged over their DDP group (DDP itself was bypassed),
    one all-reduce per dtype."""
    from torch.distributed.fsdp import FSDPModule

    from shardzoo.parallel.data_parallel import info_of
    from shardzoo.parallel.pipeline_grads import average_over_dp, hold_gathered, release_gathered

    held = [(s, hold_gathered(s)) for s in stages if isinstance(s, FSDPModule)]
    try:
        yield
    finally:
        for stage, resharding in held:
            release_gathered(stage, resharding)
    for stage in stages:
        info = info_of(stage)
        if info is not None and not info.noop and info.zero <= 1:
            average_over_dp([stage], info)


def _engine(stage: nn.Module, split: bool = False) -> nn.Module:
    """What the pipeline stage calls: a zero 0 / 1 stage's DDP engine, else the stage; under a
    split backward the stage's own forward, without DDP (``_split_step`` averages)."""
    ddp = ddp_of(stage)
    if ddp is None:
        return stage
    return ddp.module if split else ddp


_COUNTING: dict[type, type] = {}


def _counting(cls: type) -> type:
    """The torch schedule ``cls`` with a ``step`` (also behind ``eval``) that counts the real
    targets of the whole step once, before torch splits them, and gives the count to every
    microbatch's loss as ``num_targets``."""
    if cls not in _COUNTING:
        def step(self, *args, target=None, losses=None, loss_kwargs=None, **kwargs):
            loss_kwargs = dict(loss_kwargs or {})
            if (target is not None and self.count_targets is not None and "num_targets" not in loss_kwargs
                    and loss_kwargs.get("reduction", "mean") == "mean"):
                loss_kwargs["num_targets"] = self.count_targets(target, loss_kwargs.get("ignore_index", -100))
            with _split_step(getattr(self, "split_stages", [])):
                return cls.step(self, *args, target=target, losses=losses, loss_kwargs=loss_kwargs, **kwargs)

        _COUNTING[cls] = type(cls.__name__, (cls,), {"step": step, "__module__": __name__, "__doc__": cls.__doc__})
    return _COUNTING[cls]


def sync_tied_grads(stages: list[nn.Module], mesh) -> None:
    """Sum the gradients of a tied table held separately by the first and last stage: over the
    first and last pp rank, or here when this rank holds both (the V placement of zbv)."""
    if mesh.pp_size == 1:
        return
    tied_group(mesh)  # collective: every rank takes part in building the groups, middle stages too
    models = [getattr(m, "module", m) for m in stages]  # a stage in a DDP wrapper built by hand
    ends = [m for m in models if m.is_first != m.is_last]  # not a middle stage nor one holding both
    if len(ends) == 2:  # both ends here: add the two gradients locally
        first, last = sorted(ends, key=lambda m: not m.is_first)
        firsts, lasts = dict(first.named_parameters()), dict(last.named_parameters())
        for copy, table in first.tied_names.items():
            a, b = firsts.get(table), lasts.get(copy)
            if a is not None and b is not None and a.grad is not None and b.grad is not None:
                total = a.grad + b.grad
                a.grad.copy_(total)
                b.grad.copy_(total)
        return
    for model in ends:
        params = dict(model.named_parameters())
        for copy, table in model.tied_names.items():
            sum_tied_grad(params.get(table if model.is_first else copy), mesh)


class FamilyPipeline:
    """``shardzoo.pipeline`` of a family's stage(s): models built with ``stage=(k, n)`` (one per
    rank, or ``pp_rank + i * pp`` for i < v for the interleaved schedule), each optionally through
    ``data_parallel``. ``step(input_ids=..., attention_mask=..., labels=...)`` takes this dp
    replica's full tensors as a transformers model does: the first stage's input and every
    stage's padding mask are split by the family (``shard_input`` / ``shard_mask``), the labels
    become the last stage's targets (``target_from_labels``: shifted over the whole sequence for a
    causal family); :func:`build_schedule` runs the step, the tied table's two gradients are
    summed, and the loss is broadcast from the last stage to every rank."""

    def __init__(self, stages: list[nn.Module], mesh, n_microbatches: int, schedule: str):
        name = {"interleaved_1f1b": "interleaved"}.get(schedule, schedule)
        if name not in SCHEDULES or schedule == "interleaved":
            raise ValueError(f"schedule={schedule!r} is not one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble', "
                             f"'zbv', 'dualpipev'")
        self.stages, self.mesh, self.n_microbatches = list(stages), mesh, n_microbatches
        self.models = [getattr(m, "module", m) for m in self.stages]
        self.first = next((m for m in self.models if m.is_first), None)
        self.last = next((m for m in self.models if m.is_last), None)
        loss = self.last.loss if self.last is not None else self.models[0].loss
        self.schedule = build_schedule([(m.stage_index, s) for m, s in zip(self.models, self.stages)], mesh,
                                       n_microbatches=n_microbatches, schedule=name, loss_fn=loss)
        self.last_pp_rank = 0 if name in _V_PLACED else mesh.pp_size - 1  # the rank of the last stage
        if mesh.pp_size > 1 and self.models[0].tied_names:
            tied_group(mesh)  # collective: every rank builds the groups before the first step

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             labels: torch.Tensor | None = None) -> torch.Tensor:
        """One training step over this dp replica's batch; returns its loss on every rank (the
        global token mean); gradients stay in the parameters."""
        check_step(input_ids, labels, self.n_microbatches)
        model = self.models[0]
        kwargs = {} if attention_mask is None else {"key_padding_mask": model.shard_mask(attention_mask.bool())}
        args = (self.first.shard_input(input_ids),) if self.first is not None else ()
        target = {"target": self.last.target_from_labels(labels)} if self.last is not None else {}
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, losses=losses, return_outputs=False, **target, **kwargs)
        sync_tied_grads(self.stages, self.mesh)
        return step_loss(losses, self.mesh, self.last_pp_rank)
