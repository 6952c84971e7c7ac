"""A tiny GPT-2 trained for a few AdamW steps under each ZeRO stage, and the per-rank functions
the ZeRO tests send to the pools (tests/models/test_zero*.py).

Every layout has dp=2 (3D: tp=1, the only cube that fits 8 ranks next to dp=2); each dp
replica feeds its own rows of the global batch, so the parallel run must equal the serial
model trained on the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardzoo.testing import assert_close_conditioned, cached_mesh
from shardzoo.testing.dtypes import TINY_MODEL_TERMS

CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=37, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
# name -> (ParallelMesh kwargs, world size)
LAYOUTS = {
    "serial": (dict(), 1),
    "1d": (dict(dp=2, tp=2), 4),
    "2d": (dict(dp=2, tp=4, tp_mode="2d"), 8),
    "2.5d": (dict(dp=2, tp=4, tp_mode="2.5d", tp_depth=1), 8),
    "3d": (dict(dp=2, tp=1, tp_mode="3d"), 2),
    "1d_sp2": (dict(dp=2, sp=2, tp=2), 8),
    "1d_dp1": (dict(tp=2), 2),
    "pp2_dp2_tp2": (dict(pp=2, dp=2, tp=2), 8),
}
STEPS, LR, BATCH, SEQ = 3, 1e-2, 4, 8
CLIP = 0.5  # below every step's global gradient norm, so every step clips (checked)
# AdamW's eps: attention's key bias has an exactly zero gradient (softmax ignores a per-query
# constant), so in fp32 its gradient is summation noise (~1e-10) that the default eps=1e-8
# turns into steps of ~1e-2 lr, different for every summation order (serial vs two dp halves):
# an ill-conditioning of Adam, not of the sharding. eps=1e-5 keeps those steps below 1e-7.
EPS = 1e-5


def world_of(layout: str) -> int:
    """Number of ranks ``layout`` runs on."""
    return LAYOUTS[layout][1]


def mesh_of(layout: str):
    """The (cached) ParallelMesh of ``layout``."""
    return cached_mesh(**LAYOUTS[layout][0])


def batch(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) [rows, SEQ] of step ``step``: the same global batch in every layout."""
    ids = torch.randint(0, CONFIG["vocab_size"], (rows, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def build(mesh, dtype=torch.float32, stage=None, seed: int = 0):
    """The GPT-2 of CONFIG (``seed``) on ``mesh`` in ``dtype``; ``stage``: its pipeline stage."""
    from shardzoo.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(**CONFIG), mesh=mesh, seed=seed, stage=stage)
    return model.to(dtype)


def dp_rows(t: torch.Tensor, mesh) -> torch.Tensor:
    """This dp replica's rows of ``t`` [rows, ...] -> [rows / dp, ...]."""
    return t.chunk(mesh.dp_size, 0)[mesh.dp_rank]


def step_loss(model, mesh, step: int, micro: int = 1) -> torch.Tensor:
    """Forward + backward of this dp replica's rows of step ``step``, in ``micro`` micro-batches
    (all but the last under ``no_sync``); returns the detached global mean loss."""
    from shardzoo.parallel import no_sync

    ids, target = (dp_rows(t, mesh) for t in batch(step))
    losses = []
    pieces = list(zip(ids.chunk(micro), target.chunk(micro)))
    # the whole step's target count, so the micro-batch losses sum to the step's global mean
    count = model.count_targets([model.shard_target(y) for _, y in pieces]) if micro > 1 else None
    for i, (x, y) in enumerate(pieces):
        def run():
            loss = model.loss(model(model.shard_input(x)), model.shard_target(y), num_targets=count)
            loss.backward()
            losses.append(loss.detach())
        if i < micro - 1:
            with no_sync(model):
                run()
        else:
            run()
    return torch.stack(losses).sum()


def train(layout: str, zero: int, dtype=torch.float32, steps: int = STEPS, clip: float | None = None,
          micro: int = 1, **options):
    """(model, optimizer, clipping norms) after ``steps`` AdamW steps of ``layout`` under
    ``zero`` (``clip``: by the global norm, which is recorded per step)."""
    import shardzoo
    from shardzoo.models.training import clip_grad_norm_

    mesh = mesh_of(layout)
    model = shardzoo.data_parallel(build(mesh, dtype), mesh, zero=zero, **options)
    opt = shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        step_loss(model, mesh, step, micro)
        if clip is not None:
            norms.append(float(clip_grad_norm_(model, clip, mesh)))
        opt.step()
    return model, opt, norms


def full_weights(model) -> dict[str, torch.Tensor] | None:
    """``full_state_dict`` on every rank (collective); returned by global rank 0 only."""
    from shardzoo import full_state_dict

    state = full_state_dict(model)
    return state if dist.get_rank() == 0 else None


def trained_weights(layout: str, zeros: tuple[int, ...], dtype=torch.float32, clip: float | None = None,
                    micro: int = 1) -> dict | None:
    """{zero: (full weights, clipping norms) after training} for each stage in ``zeros`` (rank
    0; others None)."""
    out = {}
    for zero in zeros:
        model, _, norms = train(layout, zero, dtype, clip=clip, micro=micro)
        out[zero] = (full_weights(model), norms)
    return out if dist.get_rank() == 0 else None


def assert_weights(got: dict, serial, what: str) -> None:
    """``got`` (full weights) equals the ``serial`` fixture's weights, conditioned by its float64 run."""
    w32, w64, _ = serial
    missing = set(w32) - set(got)
    assert not missing, f"{what}: missing {sorted(missing)}"
    for name in got.keys() & w32.keys():
        assert_close_conditioned(got[name], w32[name], w64[name], f"{what} {name}", terms=TINY_MODEL_TERMS)


# -- optimizer state, checkpoints -------------------------------------------------------------
def full_optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    """Every AdamW state tensor at full (serial) size, by "<param>/<key>" (collective). A
    ZeroRedundancyOptimizer's state is summed over its group from the rank that owns it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from shardzoo.layers.shard_spec import gather_full, get_shard_spec
    from shardzoo.parallel import info_of

    zero = isinstance(opt, ZeroRedundancyOptimizer)
    state = opt.optim.state if zero else opt.state
    out = {}
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            t = state[p][key] if p in state else None
            if zero:  # only the owner holds it
                t = t.clone() if t is not None else torch.zeros(() if key == "step" else p.shape)
                dist.all_reduce(t, group=info_of(model).group)
            spec = get_shard_spec(model, name) if key != "step" else None
            out[f"{name}/{key}"] = gather_full(t, spec, model.mesh)
    return out


def train_and_save(layout: str, zero: int, ckpt_dir: str):
    """Train ``layout`` under ``zero``, save model + optimizer; (full weights, full optimizer
    state) from rank 0."""
    from shardzoo import checkpoint

    model, opt, _ = train(layout, zero)
    checkpoint.save(model, ckpt_dir, opt)
    weights, state = full_weights(model), full_optimizer_state(model, opt)
    return (weights, state) if dist.get_rank() == 0 else None


def load_into(layout: str, zero: int, ckpt_dir: str):
    """A fresh (other seed) model of ``layout`` under ``zero`` with a fresh AdamW (other lr),
    loaded from ``ckpt_dir``; (full weights, full optimizer state, lr) from rank 0."""
    import shardzoo
    from shardzoo import checkpoint
    from shardzoo.models import GPT2, GPT2Config

    mesh = mesh_of(layout)
    model = shardzoo.data_parallel(GPT2(GPT2Config(**CONFIG), mesh=mesh, seed=5), mesh, zero=zero)
    opt = shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=0.5)
    opt.zero_grad()
    step_loss(model, mesh, 9)
    opt.step()  # the state exists (and is wrong) before the load
    result = checkpoint.load(model, ckpt_dir, opt)
    assert result == checkpoint.LoadResult([], []), result
    weights, state = full_weights(model), full_optimizer_state(model, opt)
    return (weights, state, opt.param_groups[0]["lr"]) if dist.get_rank() == 0 else None


def eval_forward(model, mesh) -> None:
    """A forward without backward (evaluation): FSDP2 modules that do not reshard after
    forward stay unsharded afterwards."""
    model.eval()
    with torch.no_grad():
        model(model.shard_input(dp_rows(batch(0)[0], mesh)))
    model.train()


def save_load_after_eval(layout: str, zero: int, ckpt_dir: str):
    """Train, evaluate, save; then a fresh model (other seed) evaluates, loads and trains a
    step. (full weights saved, full weights loaded, the loss of that step) from rank 0."""
    import shardzoo
    from shardzoo import checkpoint

    mesh = mesh_of(layout)
    model, opt, _ = train(layout, zero, steps=1)
    eval_forward(model, mesh)
    checkpoint.save(model, ckpt_dir, opt)
    saved = full_weights(model)
    fresh = shardzoo.data_parallel(build(mesh, seed=5), mesh, zero=zero)
    fresh_opt = shardzoo.zero_optimizer(fresh, torch.optim.AdamW, lr=LR, eps=EPS)
    eval_forward(fresh, mesh)
    checkpoint.load(fresh, ckpt_dir, fresh_opt)
    loaded = full_weights(fresh)
    loss = step_loss(fresh, mesh, 1)
    fresh_opt.step()
    return (saved, loaded, float(loss)) if dist.get_rank() == 0 else None


def save_between_forward_and_backward(layout: str, zero: int, ckpt_dir: str):
    """One step with ``checkpoint.save`` between the forward and the backward, and the same
    step without it: (full weights after each) from rank 0."""
    import shardzoo
    from shardzoo import checkpoint

    mesh = mesh_of(layout)
    ids, target = (dp_rows(t, mesh) for t in batch(0))
    out = []
    for save in (True, False):
        model = shardzoo.data_parallel(build(mesh), mesh, zero=zero)
        opt = shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS)
        loss = model.loss(model(model.shard_input(ids)), model.shard_target(target))
        if save:  # FSDP2 holds unsharded parameters that the backward still needs
            checkpoint.save(model, ckpt_dir, opt)
        loss.backward()
        opt.step()
        out.append(full_weights(model))
    return tuple(out) if dist.get_rank() == 0 else None


# -- gradient norms, accumulation, pipelines -----------------------------------------------------
def serial_clipped(clip: float, dtype=torch.float32) -> tuple[dict, list[float]]:
    """Serial weights after STEPS AdamW steps clipped by torch.nn.utils.clip_grad_norm_, and
    the norms it returned (runs on one rank)."""
    import shardzoo

    mesh = mesh_of("serial")
    model = build(mesh, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        step_loss(model, mesh, step)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {k: v.clone() for k, v in shardzoo.full_state_dict(model).items()}, norms


def no_sync_leaves_grads_local(layout: str, zero: int) -> bool:
    """After a backward inside ``no_sync`` nothing was reduced over dp: FSDP2 has produced no
    sharded gradient yet, DDP's gradients still differ between the dp replicas."""
    import shardzoo
    from shardzoo.parallel import no_sync

    mesh = mesh_of(layout)
    model = shardzoo.data_parallel(build(mesh), mesh, zero=zero)
    ids, target = (dp_rows(t, mesh) for t in batch(0))
    with no_sync(model):
        model.loss(model(model.shard_input(ids)), model.shard_target(target)).backward()
    if zero >= 2:
        return all(p.grad is None for p in model.parameters())
    g = model.transformer.wpe.weight.grad
    replicas = [torch.empty_like(g) for _ in range(mesh.dp_size)]
    dist.all_gather(replicas, g, group=mesh.dp_group)
    return not torch.equal(replicas[0], replicas[1])


def train_pipelined(layout: str, zero: int, clip: float):
    """Pipeline stages (1F1B, 2 microbatches) each wrapped by data_parallel, clipped by the
    global norm; ({name: full weight} of this stage, norms) from dp = tp = 0 ranks."""
    import shardzoo
    from shardzoo.models.pipeline import build_schedule
    from shardzoo.models.training import clip_grad_norm_

    mesh = mesh_of(layout)
    stage = build(mesh, stage=(mesh.pp_rank, mesh.pp_size))
    stage = shardzoo.data_parallel(stage, mesh, zero=zero)  # the stage itself, wrapped in place
    opt = shardzoo.zero_optimizer(stage, torch.optim.AdamW, lr=LR, eps=EPS)
    schedule = build_schedule([(mesh.pp_rank, stage)], mesh, n_microbatches=2, loss_fn=stage.loss)
    norms = []
    for step in range(STEPS):
        ids, target = (dp_rows(t, mesh) for t in batch(step))
        opt.zero_grad()
        pipeline_step(schedule, stage, ids, target, mesh)
        norms.append(float(clip_grad_norm_([stage], clip, mesh)))
        opt.step()
    weights = shardzoo.full_state_dict(stage)
    return (weights, norms) if mesh.rank("dp", "tp") == 0 else None


def train_bf16(layout: str, zero: int):
    """Full weights after STEPS steps with FSDP2's bf16 MixedPrecisionPolicy (rank 0)."""
    return full_weights(train(layout, zero, mixed_precision="bf16")[0])


def wrapping_errors() -> list[str]:
    """The message of each refused call (on any world, dp >= 1)."""
    import shardzoo

    mesh = mesh_of("3d")
    calls = [dict(zero=4), dict(zero=True), dict(zero=0, offload=True), dict(zero=1, mixed_precision="bf16"),
             dict(zero=3, mixed_precision="fp8"), dict(zero=3, offload=True), dict(zero=2, reshard_after_forward=True)]
    out = []
    for kwargs in calls:
        try:
            shardzoo.data_parallel(build(mesh), mesh, **kwargs)
        except (ValueError, TypeError) as e:
            out.append(str(e))
        else:
            out.append("no error")
    for zero in (0, 3):
        model = shardzoo.data_parallel(build(mesh), mesh, zero=zero)
        try:
            shardzoo.data_parallel(model, mesh, zero=3)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("no error")
    return out


def single_rank_group_is_noop() -> bool:
    """dp = sp = 1: data_parallel returns the model itself (marked), for every stage."""
    import shardzoo
    from shardzoo.parallel import info_of

    mesh = mesh_of("1d_dp1")
    ok = True
    for zero in range(4):
        model = build(mesh)
        ok &= shardzoo.data_parallel(model, mesh, zero=zero) is model and info_of(model).noop
    return ok


def wrapped_in_place(layout: str) -> dict:
    """For each stage: whether ``data_parallel`` returned the model itself with its own
    parameter names, class and methods, which engine runs its calls, and whether one training
    step averaged the gradients over dp (DDP: equal on the dp replicas; FSDP2: sharded)."""
    import shardzoo
    from torch.distributed.fsdp import FSDPModule

    from shardzoo.models import GPT2
    from shardzoo.parallel import ddp_of

    mesh = mesh_of(layout)
    out = {}
    for zero in range(4):
        model = build(mesh)
        names = [n for n, _ in model.named_parameters()]
        wrapped = shardzoo.data_parallel(model, mesh, zero=zero)
        step_loss(wrapped, mesh, 0)  # wrapped.loss(wrapped(wrapped.shard_input(ids)), ...).backward()
        g = wrapped.transformer.wpe.weight.grad
        if ddp_of(wrapped) is not None:
            replicas = [torch.empty_like(g) for _ in range(mesh.dp_size)]
            dist.all_gather(replicas, g, group=mesh.dp_group)
            averaged = torch.equal(replicas[0], replicas[1])
        else:
            averaged = isinstance(wrapped, FSDPModule) and g.to_local().shape[0] < g.shape[0]
        out[zero] = dict(same=wrapped is model and isinstance(wrapped, GPT2),
                         names=[n for n, _ in wrapped.named_parameters()] == names,
                         engine="ddp" if ddp_of(wrapped) is not None else type(wrapped).__mro__[1].__name__,
                         averaged=averaged)
    return out


def pipeline_step(schedule, stage, ids, target, mesh) -> None:
    """One pipeline schedule step of a family's stage: the first stage feeds the token ids
    [b, s], the last the targets [b, s]; then the tied table's gradients are synchronised."""
    from shardzoo.models.pipeline import sync_tied_grads

    if stage.is_first:
        schedule.step(stage.shard_input(ids))
    else:
        schedule.step(target=stage.shard_target(target))
    sync_tied_grads([stage], mesh)
