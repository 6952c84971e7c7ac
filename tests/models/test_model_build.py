"""Building models: activation checkpointing replays the tp dropout streams, construction on the
meta device allocates only this rank's shards, the same seed gives the same full weights in
every layout, config.json options shardzoo does not implement are refused, and pipeline
stages train data-parallel through torch DDP."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardzoo.testing import cached_mesh, run_on_ranks
from shardzoo.testing.meshes import with_world

TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=16)
LAYOUTS = {
    "serial": with_world(),
    "1d_tp2": with_world(tp=2),
    "2d_tp4": with_world(tp=4, tp_mode="2d"),
    "pp2_2d_tp4": with_world(pp=2, tp=4, tp_mode="2d"),
    "pp2_dp2": with_world(pp=2, dp=2),
}


def data(vocab, batch=4, seq=8, seed=100):
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


# -- activation checkpointing with dropout ------------------------------------------------------
def grads_with_dropout(layout):
    from shardzoo.layers.rng_streams import manual_seed
    from shardzoo.models import GPT2, GPT2Config

    mesh = cached_mesh(**LAYOUTS[layout][0])
    config = GPT2Config(**TINY, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    ids, target = data(config.vocab_size)
    grads = {}
    for flag in (False, True):
        model = GPT2(config, mesh=mesh, checkpointing=flag, seed=1).train()
        manual_seed(mesh, 7)  # the same dropout masks in both runs, if replayed right
        loss = model.loss(model(model.shard_input(ids)), model.shard_target(target))
        loss.backward()
        grads[flag] = {n: p.grad for n, p in model.named_parameters()}
    drop_free = GPT2(GPT2Config(**TINY, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), mesh=mesh, seed=1)
    drop_free.loss(drop_free(drop_free.shard_input(ids)), drop_free.shard_target(target)).backward()
    # dropout did act (else equal gradients would prove nothing), and checkpointing replayed it
    assert any(not torch.allclose(p.grad, grads[False][n]) for n, p in drop_free.named_parameters())
    return max((grads[True][n] - g).abs().max().item() for n, g in grads[False].items())


@pytest.mark.parametrize("layout", ["serial", "1d_tp2", "2d_tp4"])
def test_checkpointing_replays_dropout(layout):
    for err in run_on_ranks(grads_with_dropout, LAYOUTS[layout][1], layout):
        assert err <= 1e-6


# -- meta-device construction and seeded init ---------------------------------------------------
class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor (numel) any op creates on a real device."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def stage_allocation(layout):
    from shardzoo.layers.shard_spec import get_shard_spec
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.meta import ROWS_PER_DRAW

    mesh = cached_mesh(**LAYOUTS[layout][0])
    config = GPT2Config(**TINY, n_inner=128)
    with LargestAllocation() as alloc:
        model = GPT2(config, mesh=mesh, stage=(mesh.pp_rank, mesh.pp_size), seed=0)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    shard_bytes = sum(4 * torch.Size(get_shard_spec(model, n).local_shape).numel() for n, _ in model.named_parameters())
    full_bytes = sum(4 * torch.Size(get_shard_spec(model, n).global_shape).numel() for n, _ in model.named_parameters())
    # no full-size tensor ever existed: at most a piece, or a block of full rows the seeded init
    # draws (2d tp4: a full row is q=2 local rows wide)
    bound = max(max(p.numel(), ROWS_PER_DRAW * p[0].numel() * 2) for p in model.parameters())
    return sum(storages.values()), shard_bytes, full_bytes, alloc.largest, bound, sorted(model.transformer.h)


def test_stage_allocates_only_its_shards():
    results = run_on_ranks(stage_allocation, 8, "pp2_2d_tp4")
    for rank, (allocated, shard, full, largest, bound, blocks) in enumerate(results):
        assert allocated == shard, rank
        assert shard * 3 < full, rank  # a quarter of the stage, plus padding
        assert largest <= bound, (rank, largest, bound)
        assert blocks == (["0"] if rank < 4 else ["1"])


def full_weights(layout, family):
    from shardzoo import models
    from shardzoo.layers.full_state import full_state_dict

    mesh = cached_mesh(**LAYOUTS[layout][0])
    configs = {"GPT2": TINY, "BERT": dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128)}
    stage = (mesh.pp_rank, mesh.pp_size) if mesh.pp_size > 1 else None
    model = getattr(models, family)(getattr(models, f"{family}Config")(**configs[family]), mesh=mesh, stage=stage,
                                    seed=5)
    return full_state_dict(model)


@pytest.mark.parametrize("family", ["GPT2", "BERT"])
def test_same_seed_same_full_weights(family):
    serial = run_on_ranks(full_weights, 1, "serial", family)[0]
    assert len({float(t.float().std()) for t in serial.values() if t.dim() == 2}) > 3  # not a constant init
    parallel = run_on_ranks(full_weights, 8, "pp2_2d_tp4", family)
    stage0, stage1 = parallel[0], parallel[-1]
    got = {**stage1, **stage0}  # the tied copy on the last stage equals the first stage's table
    assert set(got) <= set(serial) | {"lm_head.weight", "cls.predictions.decoder.weight"}
    assert set(serial) <= set(got)
    for name, t in serial.items():
        assert torch.equal(got[name], t), name


# -- config.json ------------------------------------------------------------------------------
def test_vit_num_labels_from_path_and_dict(tmp_path):
    from shardzoo.models import ViTConfig

    data = {"model_type": "vit", "hidden_size": 64, "id2label": {"0": "a", "1": "b", "2": "c"}}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert ViTConfig.from_json(data).num_labels == 3
    assert ViTConfig.from_json(tmp_path).num_labels == 3
    assert ViTConfig.from_json(tmp_path / "config.json").num_labels == 3


@pytest.mark.parametrize("family,key,value", [
    ("GPT2", "scale_attn_by_inverse_layer_idx", True), ("GPT2", "reorder_and_upcast_attn", True),
    ("GPT2", "activation_function", "silu"), ("BERT", "position_embedding_type", "relative_key"),
    ("ViT", "hidden_act", "swish"), ("OPT", "activation_function", "gelu_fast")])
def test_unimplemented_hf_options_are_refused(family, key, value):
    from shardzoo import models

    cls = getattr(models, f"{family}Config")
    with pytest.raises(ValueError, match=rf"{family}Config: {key}={value!r} is not implemented") as info:
        cls.from_json({key: value})
    assert "use a checkpoint" in str(info.value)
    supported = cls.SUPPORTED[key][0]
    assert cls.from_json({key: supported}) is not None  # the supported value passes


@pytest.mark.parametrize("family", ["BERT", "OPT"])
def test_null_pad_token_id_is_read_as_none(family):
    from shardzoo import models

    cls = getattr(models, f"{family}Config")
    assert cls.from_json({"pad_token_id": None}).pad_token_id is None  # as transformers reads it
    with pytest.raises(ValueError, match="field vocab_size must not be null"):
        cls.from_json({"vocab_size": None})  # a size stays required


# -- pipelined data parallelism through DDP -----------------------------------------------------
def pipelined_dp_grads(layout):
    import torch.distributed as dist

    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.pipeline import build_schedule
    from support.zero_stack import pipeline_step
    from shardzoo.models.training import average_grads
    from shardzoo.parallel import data_parallel, ddp_of

    mesh = cached_mesh(**LAYOUTS[layout][0])
    config = GPT2Config(**TINY, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    ids, target = data(config.vocab_size, batch=8, seed=100 + mesh.dp_rank)  # each dp rank its own rows
    grads = {}
    for use_ddp in (False, True):
        model = GPT2(config, mesh=mesh, stage=(mesh.pp_rank, mesh.pp_size), seed=2)
        stage = data_parallel(model, mesh) if use_ddp else model
        assert stage is model and (ddp_of(stage) is not None) == use_ddp
        schedule = build_schedule([(mesh.pp_rank, stage)], mesh, n_microbatches=2, loss_fn=model.loss)
        for _ in range(2):  # DDP rebuilds its buckets after the first step
            model.zero_grad()
            pipeline_step(schedule, model, ids, target, mesh)
            if not use_ddp:
                average_grads(model, mesh)
        grads[use_ddp] = {n: p.grad.clone() for n, p in model.named_parameters()}
    other = {n: g.clone() for n, g in grads[True].items()}
    for g in other.values():  # the dp replica holds the same averaged gradient
        dist.broadcast(g, group=mesh.group("dp"), group_src=0)
    return (max((grads[True][n] - g).abs().max().item() for n, g in grads[False].items()),
            max((other[n] - g).abs().max().item() for n, g in grads[True].items()))


def test_pipeline_stage_in_ddp_averages_like_average_grads():
    for vs_manual, vs_replica in run_on_ranks(pipelined_dp_grads, 4, "pp2_dp2"):
        assert vs_manual <= 1e-6 and vs_replica == 0.0
