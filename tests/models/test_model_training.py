"""Loss-curve parity: 5 AdamW steps with global-norm gradient clipping give transformers' GPT-2
losses (fp32) in several layouts: dp via DDP, tp x sp, 3D, and pipelined (1F1B over pp x 2D tp).
Also the clear errors of bad configurations and the HF name round trips."""

import pytest
import torch
import torch.nn.functional as F

from shardzoo.testing import cached_mesh, run_on_ranks
from test_model_gpt2 import converted, hf_gpt2

STEPS, LR, CLIP = 5, 1e-2, 0.5
LAYOUTS = {
    "serial": (dict(), 1),
    "1d_tp2_dp2": (dict(tp=2, dp=2), 4),
    "2d_tp4_sp2": (dict(tp=4, tp_mode="2d", sp=2), 8),
    "3d_tp8": (dict(tp=8, tp_mode="3d"), 8),
    "pp2_2d_tp4": (dict(pp=2, tp=4, tp_mode="2d"), 8),
}


def data(step, vocab, batch=4, seq=8):
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def reference_losses(seed):
    hf = hf_gpt2(seed)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, target = data(step, hf.config.vocab_size)
        loss = F.cross_entropy(hf(ids).logits.flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def train_losses(layout, seed):
    import torch.distributed as dist

    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.gpt2 import hf_to_shardzoo
    from shardzoo.models.pipeline import build_schedule, sync_tied_grads
    from shardzoo.models.training import clip_grad_norm_, data_parallel

    mesh = cached_mesh(**LAYOUTS[layout][0])
    hf = hf_gpt2(seed)
    config = GPT2Config.from_json(hf.config.to_dict())
    stage = (mesh.pp_rank, mesh.pp_size) if mesh.pp_size > 1 else None
    model = GPT2(config, mesh=mesh, stage=stage)
    model.load_full_state_dict(converted(hf.state_dict(), hf_to_shardzoo, config))
    wrapped = data_parallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = build_schedule([(mesh.pp_rank, model)], mesh, n_microbatches=2, loss_fn=model.loss) \
        if stage else None
    losses = []
    for step in range(STEPS):
        ids, target = data(step, config.vocab_size)
        rows = ids.chunk(mesh.dp_size)[mesh.dp_rank], target.chunk(mesh.dp_size)[mesh.dp_rank]
        opt.zero_grad()
        if schedule is not None:
            mb = []
            args = (model.shard_input(rows[0]),) if model.is_first else ()
            kwargs = dict(target=model.shard_target(rows[1]), losses=mb) if model.is_last else {}
            schedule.step(*args, **kwargs)
            sync_tied_grads([model], mesh)
            loss = torch.stack(mb).mean() if model.is_last else torch.zeros(())
        else:
            loss = model.loss(wrapped(model.shard_input(rows[0])), model.shard_target(rows[1]))
            loss.backward()
        clip_grad_norm_(model, CLIP, mesh)
        opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh.group("dp", "sp"))
        losses.append(value.item() / mesh.size("dp", "sp"))
    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_five_adamw_steps_match_transformers(layout):
    expected = reference_losses(0)
    results = run_on_ranks(train_losses, LAYOUTS[layout][1], layout, 0)
    mesh_kwargs = LAYOUTS[layout][0]
    last_stage_ranks = results if "pp" not in mesh_kwargs else results[len(results) // 2:]
    for losses in last_stage_ranks:
        assert losses == pytest.approx(expected, rel=2e-5, abs=2e-5)


def check_config_error(layout, family, kwargs, seq):
    from shardzoo import models

    mesh = cached_mesh(**LAYOUTS[layout][0]) if layout in LAYOUTS else cached_mesh(**layout)
    cfg_cls = getattr(models, f"{family}Config")
    try:
        model = getattr(models, family)(cfg_cls(**kwargs["config"]), mesh=mesh, **kwargs.get("build", {}))
        if seq:
            model(model.shard_input(torch.zeros(4, seq, dtype=torch.long)))
    except ValueError as e:
        return str(e)
    return None


TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=16)


def test_error_heads_not_divisible_by_tp():
    config = {**TINY, "n_embd": 48, "n_head": 3}
    for m in run_on_ranks(check_config_error, 4, "1d_tp2_dp2", "GPT2", {"config": config}, 0):
        assert m is not None and "num_heads divisible by tp=2; got num_heads=3" in m


def test_error_more_stages_than_blocks():
    for m in run_on_ranks(check_config_error, 1, "serial", "GPT2", {"config": TINY, "build": {"stage": (0, 3)}}, 0):
        assert m is not None and "has 2 blocks and cannot be split into 3 pipeline stages" in m and "pp <= 2" in m


def test_error_sequence_longer_than_positions():
    for m in run_on_ranks(check_config_error, 1, "serial", "GPT2", {"config": TINY}, 24):
        assert m is not None and "sequence length 24 exceeds n_positions=16" in m


def test_hf_names_round_trip():
    from shardzoo.models import bert, gpt2, opt, vit
    from test_model_bert import hf_bert
    from test_model_opt import hf_opt
    from test_model_vit import hf_vit

    for module, hf, cfg_cls in ((gpt2, hf_gpt2(0), gpt2.GPT2Config), (bert, hf_bert(0), bert.BERTConfig),
                                (opt, hf_opt(0), opt.OPTConfig), (vit, hf_vit(0), vit.ViTConfig)):
        config = cfg_cls.from_json(hf.config.to_dict())
        state = {k: v for k, v in hf.state_dict().items()}
        ours = converted(state, module.hf_to_shardzoo, config)
        back = converted(ours, module.shardzoo_to_hf, config)
        forward_again = converted(back, module.hf_to_shardzoo, config)
        assert set(forward_again) == set(ours)
        for name, t in ours.items():
            assert torch.equal(forward_again[name], t), name


def full_weights_after_init(layout, family):
    from shardzoo import models
    from shardzoo.layers.shard_spec import full_state_dict

    mesh = cached_mesh(**LAYOUTS[layout][0])
    configs = {"GPT2": dict(config=TINY), "ViT": dict(config=dict(num_hidden_layers=2, hidden_size=64,
                                                                  num_attention_heads=4, intermediate_size=128,
                                                                  image_size=8, patch_size=2, num_labels=3))}
    model = getattr(models, family)(getattr(models, f"{family}Config")(**configs[family]["config"]), mesh=mesh)
    model.init_weights(seed=3)
    return {k: v for k, v in full_state_dict(model).items()}


@pytest.mark.parametrize("family", ["GPT2", "ViT"])
def test_init_weights_same_in_every_layout(family):
    serial = run_on_ranks(full_weights_after_init, 1, "serial", family)[0]
    for layout in ("3d_tp8", "1d_tp2_dp2"):
        parallel = run_on_ranks(full_weights_after_init, LAYOUTS[layout][1], layout, family)[0]
        assert set(parallel) == set(serial)
        for name, t in serial.items():
            assert torch.equal(parallel[name], t), f"{layout} {name}"


def checkpointing_and_bf16(layout):
    """Activation checkpointing leaves loss and gradients unchanged; bf16 autocast stays close."""
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.training import autocast, global_grad_norm

    mesh = cached_mesh(**LAYOUTS[layout][0])
    config = GPT2Config(**TINY, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids, target = data(0, config.vocab_size)
    results = {}
    for name, flag, bf16 in (("plain", False, False), ("checkpointed", True, False), ("bf16", False, True)):
        model = GPT2(config, mesh=mesh, checkpointing=flag).train()
        model.init_weights(1)
        with autocast(bf16):
            loss = model.loss(model(model.shard_input(ids)), model.shard_target(target))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[name] = (loss.item(), global_grad_norm(model, mesh).item(), grads)
    (loss0, norm0, g0), (loss1, norm1, g1), (loss2, norm2, _) = results.values()
    assert loss1 == loss0 and norm1 == norm0
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    assert abs(loss2 - loss0) < 2e-2 * abs(loss0) and abs(norm2 - norm0) < 5e-2 * norm0
    return norm0


@pytest.mark.parametrize("layout", ["serial", "1d_tp2_dp2"])
def test_checkpointing_exact_and_bf16_close(layout):
    norms = run_on_ranks(checkpointing_and_bf16, LAYOUTS[layout][1], layout)
    assert len(set(norms)) == 1  # the global norm is the same number on every rank
