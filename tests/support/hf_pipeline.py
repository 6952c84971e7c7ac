"""Tiny transformers causal LMs (dense, and MoE with experts split over ep) cut into pipeline
stages by ``shardzoo.parallelize(..., stages=...)`` and run by ``shardzoo.pipeline``, checked
against the serial transformers model: the step's loss on every rank, and every parameter this
rank holds after one SGD step; each rank holds its stage's parameters only, and the ranks
together hold every one. Under Megatron sequence parallelism the bytes a stage sends are this tp
rank's chunk of the activation."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of
from shardzoo.testing.pools import cached_mesh
from support.hf_parallel import _step, dp_rows, padded_batch, tiny_causal_lm
from support.moe_init import tiny_moe

LAYERS = {"gpt2": "n_layer"}  # the config field of the block count, where it is not num_hidden_layers
MOE = ("mixtral", "qwen3_moe")  # tiny MoE models (support/moe_init.py), their aux loss off (a pipeline refuses it)


def tiny_model(kind: str, layers: int):
    """A tiny transformers causal LM ``kind`` with ``layers`` blocks: a dense one
    (support/hf_parallel.py) or a MoE one with decided routing and no aux loss."""
    if kind in MOE:
        return tiny_moe(kind, router_logits=False, layers=layers)
    return tiny_causal_lm(kind, **{LAYERS.get(kind, "num_hidden_layers"): layers})


def expected_names(serial, blocks: str, held_blocks: set[int], first: bool, last: bool, tied: bool) -> set[str]:
    """The serial parameter names a rank holding ``held_blocks`` (and the first / last stage) keeps."""
    inp, out = serial.get_input_embeddings().weight, serial.get_output_embeddings().weight
    names = set()
    for name, p in serial.named_parameters(remove_duplicate=False):
        if name.startswith(f"{blocks}."):
            if int(name[len(blocks) + 1:].split(".")[0]) in held_blocks:
                names.add(name)
        elif p is inp and not (tied and name.startswith("lm_head")):
            names.update([name] if first else [])
        elif name.startswith("lm_head") or name.split(".")[1] in ("norm", "ln_f"):
            names.update([name] if last else [])
        elif first:  # position table, other modules before the blocks
            names.add(name)
    return names


def check_holdings(parallel, serial) -> None:
    """This rank holds exactly the parameters of its stages (module doc)."""
    from shardzoo.layers import full_state_dict

    cut = parallel.__dict__["_shardzoo_stages"]
    held = {i for s in cut.held for i in cut.bounds(s)}
    tied = serial.get_input_embeddings().weight is serial.get_output_embeddings().weight
    want = expected_names(serial, cut.blocks, held, cut.holds_first, cut.holds_last, tied)
    serial_params = dict(serial.named_parameters(remove_duplicate=False))
    params = {n for n in full_state_dict(parallel) if n in serial_params}
    assert params == want, f"rank holds {sorted(params ^ want)} wrongly (stages {cut.held} of {cut.counts})"


def check_pipeline(kind: str, mesh_kwargs: dict, layers: int, schedule: str, n_microbatches: int, *,
                   stages=None, virtual_stages: int = 1, placement: str = "loop", zero: int | None = None,
                   sp_mode: str = "ring", checkpointing: bool = False, dtype: torch.dtype = torch.float32) -> float:
    """On every rank: one pipelined SGD step (lr 1) of a tiny ``kind`` model with ``layers`` blocks,
    its parameters in ``dtype``, equals the serial step in that dtype; returns the largest
    parameter difference."""
    import shardzoo

    batch = padded_batch()
    serial = tiny_model(kind, layers)
    exact = copy.deepcopy(serial).double()
    serial = serial.to(dtype)
    parallel = copy.deepcopy(serial)
    out_s, out_x = _step(serial, batch), _step(exact, batch)

    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, stages=stages, virtual_stages=virtual_stages, placement=placement,
                         sp_mode=sp_mode, checkpointing=checkpointing)
    if zero is not None:
        shardzoo.data_parallel(parallel, mesh, zero=zero)
    pipe = shardzoo.pipeline(parallel, mesh, n_microbatches=n_microbatches, schedule=schedule)
    ids, mask, labels = (t[dp_rows(batch[0].shape[0], mesh)] for t in batch)
    loss = pipe.step(input_ids=ids, attention_mask=mask, labels=labels)
    norm = shardzoo.models.training.global_grad_norm(parallel, mesh)  # over every stage, the tied table once
    assert_close_conditioned(norm.to(dtype), out_s.grad_norm.to(dtype), out_x.grad_norm,
                             f"{kind} {schedule} gradient norm", terms=TINY_MODEL_TERMS)
    optimizer = shardzoo.zero_optimizer(parallel, torch.optim.SGD, lr=1.0) if zero is not None else \
        torch.optim.SGD(parallel.parameters(), lr=1.0)
    optimizer.step()

    assert_close_conditioned(loss, out_s.loss.detach(), out_x.loss.detach(), f"{kind} {schedule} loss",
                             terms=TINY_MODEL_TERMS, computed_in=dtype)
    check_holdings(parallel, serial)
    full = shardzoo.full_state_dict(parallel)  # every stage's tensors, on every rank
    reference, exact_state = serial.state_dict(), exact.state_dict()
    assert set(full) == set(reference), f"names differ: {sorted(set(full) ^ set(reference))}"
    floor = rms_of(p.grad for p in exact.parameters())
    worst = 0.0
    for name, value in full.items():
        assert_close_conditioned(value, reference[name], exact_state[name], f"{kind} {schedule} {name} after a step",
                                 terms=TINY_MODEL_TERMS, floor=floor)
        worst = max(worst, (value.double() - reference[name].double()).abs().max().item())
    return worst


def check_refusals() -> None:
    """On every rank of a pp=2 mesh: each wrong pipeline argument is refused by name, before the
    model changes."""
    import pytest
    from torch import nn

    import shardzoo

    mesh = cached_mesh(pp=2)

    def refused(match: str, call) -> None:
        with pytest.raises(ValueError, match=match):
            call()

    model = tiny_causal_lm("llama", num_hidden_layers=4)
    before = [type(m) for m in model.model.layers]
    refused(r"stages=\[1, 2\] .* 2 pipeline stages .* 4 blocks", lambda: shardzoo.parallelize(model, mesh, stages=[1, 2]))
    refused(r"stages=\[4\] .* 2 pipeline stages", lambda: shardzoo.parallelize(model, mesh, stages=[4]))
    refused(r"virtual_stages=0", lambda: shardzoo.parallelize(model, mesh, virtual_stages=0))
    refused(r"fewer than its 8 pipeline stages", lambda: shardzoo.parallelize(model, mesh, virtual_stages=4))
    assert [type(m) for m in model.model.layers] == before, "a refused cut changed the model"

    class NoBlocks(nn.Module):
        pp_plan = {"a": None, "b": None}

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    refused(r"exactly one nn.ModuleList", lambda: shardzoo.parallelize(NoBlocks(), mesh, plan={"a": "column", "b": "row"}))
    refused(r"has no pipeline plan", lambda: shardzoo.parallelize(nn.Sequential(nn.Linear(4, 4)), mesh,
                                                                   plan={"0": "column"}))
    moe = shardzoo.parallelize(tiny_moe("mixtral", router_logits=True), mesh)
    refused(r"MixtralForCausalLM has config.output_router_logits=True.*output_router_logits = False",
            lambda: shardzoo.pipeline(moe, mesh, n_microbatches=2))

    shardzoo.parallelize(model, mesh)
    refused(r"schedule='interleaved' is not one of", lambda: shardzoo.pipeline(model, mesh, schedule="interleaved"))
    refused(r"'interleaved_1f1b' needs >= 2 stages per rank", lambda: shardzoo.pipeline(model, mesh,
                                                                                       schedule="interleaved_1f1b"))
    refused(r"'zbv' needs the V placement", lambda: shardzoo.pipeline(model, mesh, schedule="zbv"))
    refused(r"n_microbatches=1 is fewer than the pp=2 stages", lambda: shardzoo.pipeline(model, mesh, n_microbatches=1))
    pipe = shardzoo.pipeline(model, mesh, n_microbatches=3)
    ids, mask, labels = padded_batch()
    refused(r"n_microbatches=3 does not divide this replica's batch of 4 rows",
            lambda: pipe.step(input_ids=ids, attention_mask=mask, labels=labels))


def check_pretrained_round_trip(hf_dir: str, out_dir: str) -> None:
    """On every rank of a pp=2 x tp=2 mesh: ``from_pretrained`` with uneven stages holds this
    rank's stages only, one pipelined step equals the serial one, and ``save_pretrained`` writes
    a directory transformers loads with the serial model's logits after the step."""
    import torch.distributed as dist
    import transformers

    import shardzoo

    batch = padded_batch()
    serial = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().train()
    mesh = cached_mesh(pp=2, tp=2)
    model = shardzoo.from_pretrained(hf_dir, mesh, stages=[2, 1])
    check_holdings(model, serial)
    exact = copy.deepcopy(serial).double()
    out_s, _ = _step(serial, batch), _step(exact, batch)
    loss = shardzoo.pipeline(model, mesh, n_microbatches=2, schedule="gpipe").step(
        input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert abs(loss.item() - out_s.loss.item()) <= 1e-5, (loss.item(), out_s.loss.item())
    full = shardzoo.full_state_dict(model)
    shardzoo.save_pretrained(model, out_dir)
    dist.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).float().eval()
    written = loaded.state_dict()
    assert all(torch.equal(written[k], v) for k, v in full.items()), "the export differs from the model's tensors"
    with torch.no_grad():
        got, expected, twin = (m.eval()(input_ids=batch[0], attention_mask=batch[1]).logits
                               for m in (loaded, serial, exact))
    real = batch[1].bool()
    assert_close_conditioned(got[real], expected[real], twin[real], "exported logits after a step",
                             terms=TINY_MODEL_TERMS)


def check_checkpoint_reshards(ckpt_dir: str, target: dict, stages) -> None:
    """On every rank of 4: a pipelined Qwen2 (tied, pp=2 x tp=2) after an AdamW step is saved with
    its optimizer and loaded (strict) into the same model cut otherwise or not at all
    (``target`` mesh, ``stages``): every full tensor equals the saved model's."""
    import torch.distributed as dist

    import shardzoo
    from shardzoo import checkpoint

    batch = padded_batch()
    source = tiny_causal_lm("qwen2", num_hidden_layers=3)
    mesh = cached_mesh(pp=2, tp=2)
    shardzoo.parallelize(source, mesh)
    shardzoo.pipeline(source, mesh, n_microbatches=2).step(input_ids=batch[0], attention_mask=batch[1],
                                                            labels=batch[2])
    optimizer = torch.optim.AdamW(source.parameters(), lr=1e-2)
    optimizer.step()
    checkpoint.save(source, ckpt_dir, optimizer)
    saved = shardzoo.full_state_dict(source)
    dist.barrier()

    loaded = tiny_causal_lm("qwen2", seed=5, num_hidden_layers=3)
    mesh2 = cached_mesh(**target)
    shardzoo.parallelize(loaded, mesh2, stages=stages)
    checkpoint.load(loaded, ckpt_dir, torch.optim.AdamW(loaded.parameters(), lr=1e-2))
    full = shardzoo.full_state_dict(loaded)
    assert set(full) == set(saved), sorted(set(full) ^ set(saved))
    for name, value in saved.items():
        assert torch.equal(full[name], value), f"{name} differs after the reshard"


def _pipelined_dropout_step(serial, mesh, batch, checkpointing: bool, seed: int):
    """One pipelined 1F1B step of a copy of ``serial`` from torch seed ``seed``: (loss, this rank's
    {name: gradient})."""
    import shardzoo

    model = shardzoo.parallelize(copy.deepcopy(serial), mesh, checkpointing=checkpointing)
    pipe = shardzoo.pipeline(model, mesh, n_microbatches=2, schedule="1f1b")
    torch.manual_seed(seed)
    loss = pipe.step(**batch)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def check_pipeline_dropout() -> None:
    """On every rank of pp=2 x 1d tp=2 (Megatron sequence parallelism on): a GPT-2 with every
    dropout at 0.1 draws masks in a pipelined step (its loss differs from the same step with
    dropout off), and activation checkpointing replays them (loss and every gradient equal to
    the step without it, from the same seed)."""
    ids, mask, labels = padded_batch()
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    mesh = cached_mesh(pp=2, tp=2)
    drops = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    serial = tiny_causal_lm("gpt2", n_layer=4, **drops)
    loss, grads = _pipelined_dropout_step(serial, mesh, batch, False, seed=3)
    replayed, replayed_grads = _pipelined_dropout_step(serial, mesh, batch, True, seed=3)
    plain = tiny_causal_lm("gpt2", n_layer=4)  # the same weights (same seed), dropout off
    undropped, _ = _pipelined_dropout_step(plain, mesh, batch, False, seed=3)
    assert not torch.equal(loss, undropped), "dropout at 0.1 drew no mask in a pipelined step"
    torch.testing.assert_close(replayed, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        # the recompute replays the same kernels on the same inputs and masks: bitwise
        torch.testing.assert_close(replayed_grads[name], grad, rtol=0, atol=0, msg=f"{name} under checkpointing")


@contextlib.contextmanager
def pipeline_sends(pp_group, sent: list[int]):
    """Append to ``sent`` the bytes of each tensor torch pipelining sends on ``pp_group`` inside
    the block: its stages build a ``dist.P2POp(dist.isend, ...)`` for each send, so a subclass
    in its place sees every one."""
    original = dist.P2POp

    class Counting(original):
        def __init__(self, op, tensor, *args, **kwargs):
            super().__init__(op, tensor, *args, **kwargs)
            if op is dist.isend and self.group is pp_group:
                sent.append(tensor.numel() * tensor.element_size())

    dist.P2POp = Counting
    try:
        yield
    finally:
        dist.P2POp = original


def check_chunk_sends(seq: int, n_microbatches: int) -> int:
    """On every rank of pp=2 x 1d tp=2 (Megatron sequence parallelism on): a Llama of 2 blocks,
    one per stage, under 1F1B with a padded batch of ``seq`` tokens a row (tp need not divide
    it); a step after the first (which also sends torch's warm-up scalars) equals the serial
    loss, and each rank sends, per micro-batch, one tensor of this tp rank's chunk of the
    activation, [rows, ceil(seq / tp), hidden] (the first stage its output, the last its input
    gradient): 1/tp of the whole activation. Returns the bytes this rank sent."""
    import shardzoo

    batch = padded_batch(seq=seq)
    serial = tiny_causal_lm("llama")
    exact = copy.deepcopy(serial).double()
    out_s, out_x = _step(serial, batch), _step(exact, batch)
    mesh = cached_mesh(pp=2, tp=2)
    model = shardzoo.parallelize(tiny_causal_lm("llama"), mesh)
    pipe = shardzoo.pipeline(model, mesh, n_microbatches=n_microbatches, schedule="1f1b")
    step = dict(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
    pipe.step(**step)
    model.zero_grad()
    sent: list[int] = []
    with pipeline_sends(mesh.pp_group, sent):
        loss = pipe.step(**step)
    assert_close_conditioned(loss, out_s.loss.detach(), out_x.loss.detach(), "llama loss, chunks sent",
                             terms=TINY_MODEL_TERMS)
    rows, hidden, tp = batch[0].shape[0] // n_microbatches, serial.config.hidden_size, mesh.tp_size
    chunk = rows * -(-seq // tp) * hidden * 4  # fp32
    assert sent == [chunk] * n_microbatches, f"sent {sent}, want {n_microbatches} chunks of {chunk} bytes " \
                                             f"(the whole activation: {rows * seq * hidden * 4})"
    return sum(sent)
