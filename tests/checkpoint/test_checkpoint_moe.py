"""A MoE model split over ep, in and out of files: a tiny random Mixtral saved by transformers'
own ``save_pretrained`` (one tensor per expert and projection), read by
``shardzoo.from_pretrained`` at ep 2 (each rank reads its own experts' tensors only), a training
step, ``shardzoo.save_pretrained``, and transformers loads the result with the parallel model's
weights and logits; ``checkpoint.save`` at ep 2 loaded at ep 4, ep 1, dp 2 x sp 2 with ep 2 and
into the serial model (ZeRO 0, 1 and 3, AdamW state included); ``shardzoo convert`` of it loads in
transformers.

Weights are copied, never computed, by loading and saving: they are compared exactly. Logits
are computed: the parallel model's against transformers' on the same weights, within the
tolerance rule (fp64 twin)."""

import copy
import functools
import os

import pytest
import torch

from shardzoo.testing import assert_close_conditioned, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_parallel import dp_rows, padded_batch
from support.moe_init import decided_routing

WORLD, VOCAB, EXPERTS = 4, 96, 4


def tiny_mixtral(seed: int = 0):
    """A tiny transformers Mixtral (4 experts, top 2, 2 layers, fp32) with random weights; the
    routers drawn wide (std 1) so no token's top-2 is a near tie that rounding could flip."""
    import transformers

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=64, attn_implementation="sdpa",
                                        num_local_experts=EXPERTS, num_experts_per_tok=2,
                                        experts_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config).float().eval()
    return decided_routing(model)


def _recording_reads(weights_cls, seen: list):
    """``weights_cls.read`` that also appends the expert tensors' keys it is asked for to ``seen``."""
    read = weights_cls.read

    def recording(self, key, *args, **kwargs):
        if ".experts." in key:
            seen.append(key)
        return read(self, key, *args, **kwargs)

    return recording


def pretrained_step_and_save(hf_dir: str, out_dir: str, mesh_kwargs: dict, zero: int):
    """On every rank: from_pretrained at ``mesh_kwargs`` (recording which expert tensors this
    rank reads), one AdamW step, save_pretrained. Returns (expert keys read, this rank's
    experts before the step, the logits after the step [whole batch], the full state)."""
    import shardzoo
    from shardzoo.checkpoint.hf_files import HFWeights

    mesh = cached_mesh(**mesh_kwargs)
    seen, original = [], HFWeights.read
    HFWeights.read = _recording_reads(HFWeights, seen)
    try:
        model = shardzoo.from_pretrained(hf_dir, mesh)
    finally:
        HFWeights.read = original
    loaded = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    wrapped = shardzoo.data_parallel(model, mesh, zero=zero)
    rows = dp_rows(4, mesh)
    ids, mask, labels = (t[rows] for t in padded_batch(rows=4, seq=16, vocab=VOCAB))
    wrapped.train()
    wrapped(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    shardzoo.zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-2).step()
    wrapped.eval()
    with torch.no_grad():
        logits = wrapped(input_ids=ids, attention_mask=mask).logits
    logits = shardzoo.gather_logits(model, logits)
    shardzoo.save_pretrained(wrapped, out_dir)
    return sorted(set(seen)), loaded, (rows, logits), shardzoo.full_state_dict(wrapped)


@pytest.mark.parametrize("zero", [0, 3])
def test_from_pretrained_step_save_pretrained(tmp_path, zero):
    import transformers

    hf = tiny_mixtral()
    hf_dir, out_dir = str(tmp_path / "hf"), str(tmp_path / "out")
    hf.save_pretrained(hf_dir)
    mesh_kwargs = dict(dp=4, ep=2)
    fn = functools.partial(pretrained_step_and_save, mesh_kwargs=mesh_kwargs, zero=zero)
    results = run_on_ranks(fn, WORLD, hf_dir, out_dir)
    serial = hf.state_dict()
    for rank, (seen, loaded, _, _) in enumerate(results):
        ep_rank = rank % 2
        mine = {str(e) for e in range(ep_rank * 2, ep_rank * 2 + 2)}
        assert seen and all(k.split(".experts.")[1].split(".")[0] in mine for k in seen), (rank, seen)
        for name, local in loaded.items():
            assert torch.equal(local, serial[name][ep_rank * 2:ep_rank * 2 + 2]), name
    reloaded = transformers.MixtralForCausalLM.from_pretrained(out_dir, experts_implementation="eager").float().eval()
    full = results[0][3]
    state = reloaded.state_dict()
    assert set(full) <= set(state)
    for name, tensor in full.items():
        assert torch.equal(state[name], tensor), name
    assert not torch.equal(state["model.layers.0.mlp.experts.gate_up_proj"],
                           serial["model.layers.0.mlp.experts.gate_up_proj"])  # the step moved the experts
    ids, mask, _ = padded_batch(rows=4, seq=16, vocab=VOCAB)
    exact = copy.deepcopy(reloaded).double()
    with torch.no_grad():
        want, twin = reloaded(input_ids=ids, attention_mask=mask).logits, exact(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    for _, _, (rows, logits), _ in results:
        assert_close_conditioned(logits[keep[rows]], want[rows][keep[rows]], twin[rows][keep[rows]],
                                 f"logits of the saved model, zero={zero}", terms=TINY_MODEL_TERMS)


def _train_step(model, mesh, zero: int):
    """``model`` under ``data_parallel(zero)`` after one AdamW step on its rows of the batch;
    returns (the wrapped model, its optimizer)."""
    import shardzoo

    wrapped = shardzoo.data_parallel(model, mesh, zero=zero)
    rows = dp_rows(4, mesh)
    ids, mask, labels = (t[rows] for t in padded_batch(rows=4, seq=16, vocab=VOCAB))
    wrapped.train()
    wrapped(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-2)
    optimizer.step()
    optimizer.zero_grad()
    return wrapped, optimizer


def save_after_step(ckpt: str, mesh_kwargs: dict, zero: int):
    """On every rank: the tiny Mixtral split at ``mesh_kwargs``, one AdamW step, checkpoint.save
    with the optimizer. Returns the full state."""
    import shardzoo
    from shardzoo import checkpoint

    mesh = cached_mesh(**mesh_kwargs)
    wrapped, optimizer = _train_step(shardzoo.parallelize(tiny_mixtral(), mesh), mesh, zero)
    checkpoint.save(wrapped, ckpt, optimizer)
    return shardzoo.full_state_dict(wrapped)


def load_and_save(ckpt: str, again: str, mesh_kwargs: dict, zero: int):
    """On every rank: a fresh tiny Mixtral (other weights) split at ``mesh_kwargs`` with an AdamW
    of its own, filled from ``ckpt``, saved into ``again``. Returns (the rows, the logits of the
    loaded model on them)."""
    import shardzoo
    from shardzoo import checkpoint

    mesh = cached_mesh(**mesh_kwargs)
    model = shardzoo.parallelize(tiny_mixtral(seed=1), mesh)
    wrapped, optimizer = _train_step(model, mesh, zero)  # state of another run, overwritten by the load
    checkpoint.load(wrapped, ckpt, optimizer)
    rows = dp_rows(4, mesh)
    ids, mask, _ = (t[rows] for t in padded_batch(rows=4, seq=16, vocab=VOCAB))
    wrapped.eval()
    with torch.no_grad():
        logits = shardzoo.gather_logits(model, wrapped(input_ids=ids, attention_mask=mask).logits)
    checkpoint.save(wrapped, again, optimizer)
    return rows, logits


def serial_state(ckpt: str):
    """The serial tiny Mixtral and its AdamW filled from ``ckpt`` in this process."""
    from shardzoo import checkpoint

    model = tiny_mixtral(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()  # creates the state the load overwrites
    checkpoint.load(model, ckpt, optimizer)
    return model, optimizer


def _assert_same_state(a, b, what: str):
    (ma, oa), (mb, ob) = a, b
    for (name, x), y in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(x, y), f"{what}: {name}"
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key])), f"{what}: state {k} {key}"


def _convert_and_compare(ckpt: str, out_dir: str, reference, batch, want, twin):
    """``shardzoo convert`` of ``ckpt`` loads in transformers with the reference's weights and logits."""
    import transformers

    from shardzoo.cli import main

    assert main(["convert", ckpt, out_dir, "--no-progress"]) == 0
    loaded = transformers.MixtralForCausalLM.from_pretrained(out_dir, experts_implementation="eager").float().eval()
    got = loaded.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(got[name], value), name
    ids, mask = batch
    with torch.no_grad():
        logits = loaded(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert_close_conditioned(logits[keep], want[keep], twin[keep], "logits of the converted model", terms=TINY_MODEL_TERMS)


SAVED_AT = dict(dp=4, ep=2)
# each layout with the ZeRO stage it loads at after a save at ZeRO 0 and at ZeRO 3: across stages,
# ZeRO 1 (the experts' AdamW state partitioned over edp, loaded and saved again) at each ep
LOADED_AT = [(dict(dp=4, ep=4), {0: 3, 3: 1}), (dict(dp=4), {0: 0, 3: 3}), (dict(dp=2, sp=2, ep=2), {0: 1, 3: 0}),
             (dict(dp=4, ep=2), {0: 3, 3: 1})]


@pytest.mark.parametrize("zero", [0, 3])
def test_save_at_ep2_load_at_other_layouts(tmp_path, zero):
    ckpt = str(tmp_path / "ckpt")
    full = run_on_ranks(functools.partial(save_after_step, mesh_kwargs=SAVED_AT, zero=zero), WORLD, ckpt)[0]
    reference = serial_state(ckpt)
    for name, tensor in reference[0].state_dict().items():
        assert torch.equal(tensor, full[name]), name  # the file holds every rank's experts
    exact = copy.deepcopy(reference[0]).double().eval()
    ids, mask, _ = padded_batch(rows=4, seq=16, vocab=VOCAB)
    with torch.no_grad():
        want = reference[0].eval()(input_ids=ids, attention_mask=mask).logits
        twin = exact(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    _convert_and_compare(ckpt, str(tmp_path / "converted"), reference[0], (ids, mask), want, twin)
    for i, (mesh_kwargs, stages) in enumerate(LOADED_AT):
        again = str(tmp_path / f"again-{i}")
        load_zero = stages[zero]
        results = run_on_ranks(functools.partial(load_and_save, mesh_kwargs=mesh_kwargs, zero=load_zero), WORLD, ckpt,
                               again)
        for rows, logits in results:
            assert_close_conditioned(logits[keep[rows]], want[rows][keep[rows]], twin[rows][keep[rows]],
                                     f"logits loaded at {mesh_kwargs}", terms=TINY_MODEL_TERMS)
        _assert_same_state(reference, serial_state(again),
                           f"saved at {SAVED_AT} zero={zero}, loaded at {mesh_kwargs} zero={load_zero}")
