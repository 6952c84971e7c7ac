"""Megatron sequence parallelism in 1d (parallel/megatron_sp.py, on by default): transformers
Llama, Qwen2 and GPT-2 and the four families at tp 2 and 4, with and without sp, dropout,
activation checkpointing and a sequence tp does not divide: loss, logits and every weight after
one SGD step equal the serial model; ``sequence_parallel=False`` still does; and between the
blocks a rank holds 1/tp of the sequence."""

import copy

import pytest

pytest.importorskip("transformers", reason="transformers is in the test extra; these tests build its models")

import torch  # noqa: E402

from shardzoo.testing import assert_close, cached_mesh, run_on_ranks  # noqa: E402
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of  # noqa: E402

VOCAB, BATCH = 64, 2


def _tiny(kind: str, dropout: float = 0.0):
    """A tiny transformers causal LM (hidden 32, 2 layers), fp32, training mode."""
    import transformers

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="sdpa")
    if kind == "llama":
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        cls, config = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common, tie_word_embeddings=True)
    else:  # attention dropout stays 0: SDPA draws it over a rank's heads, which is not the serial draw
        cls, config = transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    return cls(config).float().train()


def _batch(seq: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _hf_step(model, ids, mask, labels, seed: int):
    torch.manual_seed(seed)  # the dropout masks: the same draws on every rank and in the serial model
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out


def _check_step(loss_p, loss_s, logits_p, logits_s, full: dict, reference: dict, serial, what: str,
                parts: int) -> None:
    """Loss, logits and every weight after the step (``full``: the parallel model's, gathered;
    ``reference``: the serial model's) against the serial model within the reorder bound of the tiny models' reductions; a weight's
    change is its gradient, whose summands' size is the gradients' (a key bias' gradient is 0 in
    exact arithmetic and computed as rounding noise of that size)."""
    tol = dict(terms=TINY_MODEL_TERMS, parts=parts)
    assert_close(loss_p, loss_s, f"{what} loss", **tol)
    assert_close(logits_p, logits_s, f"{what} logits", **tol)
    floor = rms_of(p.grad for p in serial.parameters())
    for name, value in reference.items():
        assert_close(full[name], value, f"{what} {name} after a step", floor=floor, **tol)


def _check_hf(kind: str, mesh_kwargs: dict, options: dict) -> None:
    _check_hf_with(kind, mesh_kwargs, **options)


def _check_hf_with(kind: str, mesh_kwargs: dict, sp_mode: str = "ring", seq: int = 16, dropout: float = 0.0,
                   checkpointing: bool = False, sequence_parallel: bool = True) -> None:
    import shardzoo

    serial = _tiny(kind, dropout)
    parallel = copy.deepcopy(serial)
    ids, mask, labels = _batch(seq)
    out_s = _hf_step(serial, ids, mask, labels, seed=5)
    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, sp_mode=sp_mode, checkpointing=checkpointing,
                         sequence_parallel=sequence_parallel)
    out_p = _hf_step(parallel, ids, mask, labels, seed=5)
    for model in (serial, parallel):
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    real = mask.bool()
    logits = shardzoo.gather_logits(parallel, out_p.logits.detach())
    _check_step(out_p.loss.detach(), out_s.loss.detach(), logits[real], out_s.logits.detach()[real],
                shardzoo.full_state_dict(parallel), serial.state_dict(), serial, kind, mesh.tp_size)


# (model, mesh, world, {options})
HF_CASES = {
    "llama-tp2": ("llama", dict(tp=2), 2, {}),
    "llama-tp4-seq14-padded": ("llama", dict(tp=4), 4, dict(seq=14)),
    "llama-tp2-sp2-ring-checkpointing": ("llama", dict(tp=2, sp=2), 4, dict(checkpointing=True)),
    "qwen2-tp2-sp2-ulysses": ("qwen2", dict(tp=2, sp=2), 4, dict(sp_mode="ulysses")),
    "qwen2-tp2-seq9-checkpointing": ("qwen2", dict(tp=2), 2, dict(seq=9, checkpointing=True)),
    "gpt2-tp2-dropout": ("gpt2", dict(tp=2), 2, dict(dropout=0.2)),
    "gpt2-tp2-dropout-checkpointing-seq11": ("gpt2", dict(tp=2), 2, dict(dropout=0.2, checkpointing=True, seq=11)),
    "gpt2-tp2-sp2-ring": ("gpt2", dict(tp=2, sp=2), 4, {}),
    "llama-tp2-off": ("llama", dict(tp=2), 2, dict(sequence_parallel=False)),
    "gpt2-tp2-dropout-off": ("gpt2", dict(tp=2), 2, dict(dropout=0.2, sequence_parallel=False)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_model_with_megatron_sp_equals_serial(case):
    kind, mesh_kwargs, world, options = HF_CASES[case]
    run_on_ranks(_check_hf, world, kind, mesh_kwargs, options)


def _between_block_lengths(tp: int, seq: int, sequence_parallel: bool) -> list[int]:
    """The sequence length of every norm input and block output of a parallelized Llama at tp."""
    import shardzoo

    model = _tiny("llama")
    shardzoo.parallelize(model, cached_mesh(tp=tp), sequence_parallel=sequence_parallel)
    seen = []
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    model.model.layers[0].register_forward_hook(lambda m, a, y: seen.append((y[0] if isinstance(y, tuple) else y)
                                                                            .shape[1]))
    ids, mask, labels = _batch(seq)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return seen


@pytest.mark.parametrize("tp, seq", [(2, 16), (4, 14)])
def test_between_block_activations_hold_one_tpth_of_the_sequence(tp, seq):
    """Norm inputs (the residual stream) and the first block's output: ceil(seq / tp) tokens on
    a rank with Megatron sequence parallelism, the whole sequence without."""
    on = run_on_ranks(_between_block_lengths, tp, tp, seq, True)
    off = run_on_ranks(_between_block_lengths, tp, tp, seq, False)
    assert all(n == -(-seq // tp) for rank in on for n in rank) and len(on[0]) == 5, on
    assert all(n == seq for rank in off for n in rank), off


def _hidden_states(tp: int) -> float:
    """The largest difference between the hidden states a parallelized Llama returns with
    ``output_hidden_states=True`` (recorded at its blocks, where they are chunks) and the serial model's."""
    import shardzoo

    model = _tiny("llama").eval()
    ids, mask, _ = _batch(13)
    serial = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    shardzoo.parallelize(model, cached_mesh(tp=tp))
    states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert [tuple(h.shape) for h in states] == [tuple(h.shape) for h in serial], [h.shape for h in states]
    for i, (h, ref) in enumerate(zip(states, serial)):
        assert_close(h, ref, f"hidden state {i}", terms=TINY_MODEL_TERMS, parts=tp)
    return max(float((h - ref).abs().max()) for h, ref in zip(states, serial))


def test_output_hidden_states_are_whole_sequences():
    """A user asking for every block's hidden states gets [b, s, H] on every rank, equal to serial,
    not this rank's chunk of them (13 tokens on tp=2: padded chunks)."""
    run_on_ranks(_hidden_states, 2, 2)


# -- the families ---------------------------------------------------------------------------------
def _family_batch(family: str, config, seq: int):
    g = torch.Generator().manual_seed(2)
    if family == "vit":
        return torch.randn(BATCH, 3, config.image_size, config.image_size, generator=g), \
            torch.randint(0, config.num_labels, (BATCH,), generator=g)
    ids = torch.randint(0, config.vocab_size, (BATCH, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _family_step(model, x, target, seed: int):
    torch.manual_seed(seed)
    logits = model(model.shard_input(x))
    loss = model.loss(logits, model.shard_target(target))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return loss.detach(), model.gather_output(logits.detach())


def _check_family(family: str, mesh_kwargs: dict, options: dict) -> None:
    _check_family_with(family, mesh_kwargs, **options)


def _check_family_with(family: str, mesh_kwargs: dict, seq: int = 8, dropout: float = 0.0,
                       checkpointing: bool = False, sequence_parallel: bool = True) -> None:
    import shardzoo
    from shardzoo.models.spec import spec_named

    spec = spec_named(family)
    config = spec.config.from_json(spec.tiny_config(2, VOCAB, 64, dropout, hidden=32, heads=4))
    x, target = _family_batch(family, config, seq)
    mesh = cached_mesh(**mesh_kwargs)
    # the serial model on every rank: each dp rank of a dp-only mesh runs the whole batch on its own
    serial = spec.model(config, mesh=cached_mesh(dp=mesh.world_size), seed=3).train()
    parallel = spec.model(config, mesh=mesh, seed=3, checkpointing=checkpointing,
                          sequence_parallel=sequence_parallel).train()
    for model in (serial, parallel):  # a family's gradients are averaged over dp x sp by data_parallel
        shardzoo.data_parallel(model, model.mesh)
    loss_s, logits_s = _family_step(serial, x, target, seed=7)
    loss_p, logits_p = _family_step(parallel, x, target, seed=7)
    _check_step(loss_p, loss_s, logits_p, logits_s, shardzoo.full_state_dict(parallel), shardzoo.full_state_dict(serial),
                serial, family, mesh.tp_size)


FAMILY_CASES = {
    "gpt2-tp2-dropout": ("gpt2", dict(tp=2), 2, dict(dropout=0.1)),
    "gpt2-tp4-seq6-padded": ("gpt2", dict(tp=4), 4, dict(seq=6)),
    "gpt2-tp2-sp2-checkpointing": ("gpt2", dict(tp=2, sp=2), 4, dict(checkpointing=True)),
    "bert-tp2-dropout-checkpointing": ("bert", dict(tp=2), 2, dict(dropout=0.1, checkpointing=True)),
    "bert-tp4": ("bert", dict(tp=4), 4, {}),
    "opt-tp2-sp2": ("opt", dict(tp=2, sp=2), 4, {}),
    "opt-tp4-seq7-padded": ("opt", dict(tp=4), 4, dict(seq=7)),
    "vit-tp2": ("vit", dict(tp=2), 2, {}),
    "vit-tp4-checkpointing": ("vit", dict(tp=4), 4, dict(checkpointing=True)),
    "gpt2-tp2-off": ("gpt2", dict(tp=2), 2, dict(sequence_parallel=False)),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_family_with_megatron_sp_equals_serial(case):
    family, mesh_kwargs, world, options = FAMILY_CASES[case]
    run_on_ranks(_check_family, world, family, mesh_kwargs, options)


def _partial_grad_sums(tp: int) -> list[int]:
    """Payload bytes of each all-reduce over tp in the backward of a 2-block transformers GPT-2
    with Megatron sequence parallelism (no dp, no sp: every all-reduce is a tp one)."""
    import shardzoo
    from shardzoo import comm

    model = _tiny("gpt2")
    ids, mask, labels = _batch(16)
    shardzoo.parallelize(model, cached_mesh(tp=tp))
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    with comm.count() as counter:
        out.loss.backward()
    return [r.payload_bytes for r in counter.records if r.kind == "all_reduce" and r.group_size == tp]


def test_partial_gradients_are_summed_once_per_block():
    """A block's norms (weight, bias: 2 x 2 x 32) and row biases (2 x 32) see only this rank's
    tokens; their gradients travel in one all-reduce per block, not one per parameter."""
    block_bytes = (2 * 2 * 32 + 2 * 32) * 4  # fp32
    sums = run_on_ranks(_partial_grad_sums, 2, 2)[0]
    assert sums.count(block_bytes) == 2, sums  # the two blocks
    assert 32 * 4 not in sums, sums  # no single norm weight or row bias on its own
    # the planner prices the same: one all-reduce of them all per block
    from shardzoo.planner.block_costs import costs_of
    from shardzoo.planner.model import Batch
    from shardzoo.planner.walked import walked_model

    parts = walked_model(_tiny("gpt2")).parts(costs_of("1d", 2, 1, 4), Batch(BATCH, 16, 1, "ring", 4, chunks=2))
    grouped = [c for p in parts.block for c in p.calls if c.per_block]
    assert [(c.kind, c.payload) for c in grouped] == [("all_reduce", block_bytes)], grouped
