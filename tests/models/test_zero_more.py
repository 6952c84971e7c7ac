"""ZeRO beyond the plain step (tests/support/zero_stack.py): pipeline stages, gradient
accumulation without a reduce per micro-batch, bf16 mixed precision, checkpoints resharded
across dp sizes, ZeRO stages and tp_modes (model and AdamW state), convert, and the errors."""

import pytest
import torch

from shardzoo.testing import assert_close, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, ZERO_BF16_REL_TOL
from support.zero_stack import (CLIP, assert_weights, load_into, no_sync_leaves_grads_local, save_load_after_eval,
                                         save_between_forward_and_backward, single_rank_group_is_noop, train_and_save, train_bf16, train_pipelined, trained_weights, world_of,
                                         wrapped_in_place, wrapping_errors)


def convert_to_files(ckpt_dir: str, out_dir: str) -> dict[str, torch.Tensor]:
    """``shardzoo convert CKPT OUT --names shardzoo`` (in process); the tensors written."""
    from safetensors.torch import load_file

    from shardzoo.cli import main

    assert main(["convert", ckpt_dir, out_dir, "--names", "shardzoo", "--no-progress"]) == 0
    import pathlib

    return {k: v for f in sorted(pathlib.Path(out_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def test_pipeline_pp2_dp2_tp2_zero3_equals_serial(zero_serial):
    per_rank = run_on_ranks(train_pipelined, world_of("pp2_dp2_tp2"), "pp2_dp2_tp2", 3, CLIP)
    got = [r for r in per_rank if r is not None]
    assert len(got) == 2  # one report per stage
    weights = {**got[0][0], **got[1][0]}
    assert_weights(weights, zero_serial, "pp2 dp2 tp2 zero=3")
    assert_close(torch.tensor(got[0][1]), torch.tensor(zero_serial[2]), "pipelined global_grad_norm",
                 terms=TINY_MODEL_TERMS)


def test_accumulation_without_reduce_equals_one_batch(zero_serial):
    """Two micro-batches (the first under no_sync) clipped per step equal the serial big batch;
    and inside no_sync nothing is reduced (DDP replicas differ, FSDP2 made no sharded grad)."""
    results = run_on_ranks(trained_weights, world_of("1d"), "1d", (0, 3), torch.float32, CLIP, 2)[0]
    for zero, (weights, norms) in results.items():
        assert_weights(weights, zero_serial, f"accumulated zero={zero}")
        assert_close(torch.tensor(norms), torch.tensor(zero_serial[2]), f"accumulated zero={zero} global_grad_norm",
                     terms=TINY_MODEL_TERMS)
    for zero in (0, 3):
        assert all(run_on_ranks(no_sync_leaves_grads_local, world_of("1d"), "1d", zero)), zero


@pytest.mark.parametrize("zero", [2, 3])
def test_bf16_mixed_precision_within_measured_tolerance(zero):
    got = run_on_ranks(train_bf16, world_of("1d"), "1d", zero)[0]
    ref = run_on_ranks(trained_weights, 1, "serial", (0,))[0][0][0]
    err = sum(float((got[k].float() - v).norm()) ** 2 for k, v in ref.items()) ** 0.5
    rel = err / sum(float(v.norm()) ** 2 for v in ref.values()) ** 0.5
    assert all(got[k].dtype == torch.float32 for k in ref), "master weights must stay fp32"
    assert 0 < rel < ZERO_BF16_REL_TOL, f"bf16 zero={zero}: relative error of the weights {rel:.2e}"


@pytest.mark.parametrize("saved, loaded", [(("2d", 3), ("1d_dp1", 0)), (("2d", 3), ("serial", 0)),
                                           (("1d", 1), ("2.5d", 2))])
def test_checkpoint_reshards_across_dp_zero_and_tp_mode(tmp_path, saved, loaded):
    """Saved under one (layout, zero), loaded into another: bit-equal full weights and AdamW
    state (ZeroRedundancyOptimizer and FSDP2 state resharded), lr restored; convert writes the
    same full tensors."""
    ckpt = str(tmp_path / "ckpt")
    weights, state = run_on_ranks(train_and_save, world_of(saved[0]), saved[0], saved[1], ckpt)[0]
    w2, s2, lr = run_on_ranks(load_into, world_of(loaded[0]), loaded[0], loaded[1], ckpt)[0]
    assert lr == 1e-2
    for name, t in weights.items():
        assert torch.equal(w2[name], t), name
    for name, t in state.items():
        assert torch.equal(s2[name], t), name
    if loaded[0] == "serial":
        files = convert_to_files(ckpt, str(tmp_path / "plain"))
        for name, t in weights.items():
            if name in files:
                assert torch.equal(files[name], t), name
        assert "transformer.wte.weight" in files


def test_errors_name_the_value_and_the_fix():
    messages = run_on_ranks(wrapping_errors, world_of("3d"))[0]
    expect = ["zero=4", "zero=True", "offload is an FSDP2 option", "mixed_precision is an FSDP2 option",
              "mixed_precision='fp8'", "no device to offload from", "reshard_after_forward=True", "already wrapped",
              "already wrapped"]
    for got, want in zip(messages, expect, strict=True):
        assert want in got, (want, got)
    assert all(run_on_ranks(single_rank_group_is_noop, world_of("1d_dp1")))


def custom_model_steps(zero: int) -> dict[str, torch.Tensor] | None:
    """A user's own module of shardzoo layers (two residual 1D MLP blocks), wrapped at ``zero``
    on dp=2 x tp=2 and trained 3 steps with a plain ``torch.optim.AdamW(model.parameters())``
    (zero=1: shardzoo.zero_optimizer); returns the full weights on rank 0, and the serial twin's
    after the same steps on the whole batch."""
    from torch import nn

    import shardzoo
    from shardzoo.layers import ParallelLinear1D
    from shardzoo.layers.full_state import full_state_dict
    from shardzoo.testing import cached_mesh

    class Block(nn.Module):
        def __init__(self, up, down):
            super().__init__()
            self.up, self.down = up, down

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    serial = nn.Sequential(*(Block(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2)))
    mesh = cached_mesh(dp=2, tp=2)
    model = nn.Sequential(*(Block(ParallelLinear1D.from_serial(b.up, mesh, style="column"),
                                  ParallelLinear1D.from_serial(b.down, mesh, style="row")) for b in serial))
    model = shardzoo.data_parallel(model, mesh, zero=zero)
    opt = (shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-5) if zero == 1
           else torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5))
    ref_opt = torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=1e-5)
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x.chunk(2)[mesh.dp_rank]).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        serial(x).square().mean().backward()
        ref_opt.step()
    got = full_state_dict(model)
    return (got, serial.state_dict()) if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_custom_module_of_shardzoo_layers_with_plain_adamw_equals_serial(zero):
    got, ref = run_on_ranks(custom_model_steps, 4, zero)[0]
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert_close(got[k], v, f"zero={zero}: {k}", terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("zero", [2, 3])
def test_checkpoint_after_an_evaluation_forward(tmp_path, zero):
    """A forward without backward leaves FSDP2's root (zero=3) or every unit (zero=2)
    unsharded; save and load still see the sharded parameters the optimizer holds, the load
    is not lost at the next gather, and training goes on."""
    saved, loaded, loss = run_on_ranks(save_load_after_eval, world_of("1d"), "1d", zero, str(tmp_path / "ckpt"))[0]
    assert saved.keys() == loaded.keys()
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name
    assert loss == loss and loss > 0  # finite: the step after the load ran


@pytest.mark.parametrize("zero", [2, 3])
def test_checkpoint_between_forward_and_backward(tmp_path, zero):
    """Saving while the backward still needs FSDP2's unsharded parameters: the backward gathers
    them again, and the step is the one without the save, bit for bit."""
    with_save, without = run_on_ranks(save_between_forward_and_backward, world_of("1d"), "1d", zero,
                                      str(tmp_path / "ckpt"))[0]
    for name, t in without.items():
        assert torch.equal(with_save[name], t), name


def test_data_parallel_returns_the_model_itself_at_every_stage():
    """One return type for every ZeRO stage: the model, wrapped in place (same names, its own
    loss / shard_input), DDP behind its calls at zero 0 / 1 and FSDP2 at 2 / 3."""
    got = run_on_ranks(wrapped_in_place, world_of("1d"), "1d")[0]
    for zero in range(4):
        assert got[zero]["same"] and got[zero]["names"], (zero, got[zero])
        assert got[zero]["engine"] == ("ddp" if zero < 2 else "FSDPModule"), (zero, got[zero])
        assert got[zero]["averaged"], (zero, got[zero])
