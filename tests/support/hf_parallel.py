"""Tiny transformers causal LMs run by their own code, split by ``shardzoo.parallelize``, and the
harness that checks them against the serial transformers model: loss, logits and every
parameter after one optimizer step, with padding.

transformers is imported only inside the builders. The reference is the serial fp32 model;
its fp64 twin bounds the serial run's own rounding (``assert_close_conditioned``).
"""

from __future__ import annotations

import copy

import torch

from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from shardzoo.testing.pools import cached_mesh

VOCAB, SEQ, BATCH = 96, 16, 4


def _config(kind: str):
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
    if kind == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if kind == "qwen2":  # tied embeddings, q / k / v biases
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "gpt2":  # Conv1D weights, q|k|v packed in c_attn, tied embeddings, learned positions
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    if kind == "mistral":
        return transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=32)
    raise ValueError(f"unknown tiny model {kind!r}; one of llama, qwen2, mistral, gpt2")


def tiny_causal_lm(kind: str, seed: int = 0):
    """A transformers ``*ForCausalLM`` with random weights drawn from ``seed`` (fp32)."""
    cls, config = _config(kind)
    torch.manual_seed(seed)
    return cls(config).float().train()


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [BATCH, SEQ], two rows right-padded, labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0
    mask[3, SEQ - 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _grad_norm(model) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))


def _step(model, batch, lr: float = 1.0):
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    out.grad_norm = _grad_norm(model)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return out


def check_against_serial(kind: str, mesh_kwargs: dict, sp_mode: str = "ring", zero: int = 0,
                         dtype: torch.dtype = torch.float32, wrap: bool = True, plan: dict | None = None) -> dict:
    """On every rank: parallelize a tiny ``kind`` model on the cached mesh of ``mesh_kwargs``,
    wrap it with ``data_parallel(zero=...)`` (parameters in ``dtype``; ``wrap=False``: no
    wrapper, the gradients as ``backward()`` leaves them), run one SGD step on this dp
    replica's rows (``plan``: passed to ``parallelize``; None: the model's own), and assert loss, gathered logits, the global gradient norm and every full
    parameter equal the serial step's. Returns the largest differences (for reports)."""
    import shardzoo

    batch = padded_batch()
    serial = tiny_causal_lm(kind)
    exact = copy.deepcopy(serial).double()
    serial = serial.to(dtype)
    parallel = copy.deepcopy(serial)
    out_s, out_x = _step(serial, batch), _step(exact, batch)

    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, plan, sp_mode=sp_mode)
    wrapped = shardzoo.data_parallel(parallel, mesh, zero=zero) if wrap else parallel
    rows = slice(mesh.dp_rank * BATCH // mesh.dp_size, (mesh.dp_rank + 1) * BATCH // mesh.dp_size)
    ids, mask, labels = (t[rows] for t in batch)
    out_p = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    out_p.loss.backward()
    from shardzoo.models.training import global_grad_norm

    norm = global_grad_norm(wrapped, mesh)  # each distinct piece once: kv copies and replicas skipped
    optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.SGD, lr=1.0) if wrap else \
        torch.optim.SGD(parallel.parameters(), lr=1.0)
    optimizer.step()

    real = mask.bool()
    logits = shardzoo.gather_logits(parallel, out_p.logits.detach())
    assert_close_conditioned(out_p.loss.detach(), out_s.loss.detach(), out_x.loss.detach(), f"{kind} loss",
                             terms=TINY_MODEL_TERMS)
    assert_close_conditioned(logits[real], out_s.logits[rows][real], out_x.logits[rows][real], f"{kind} logits",
                             terms=TINY_MODEL_TERMS)
    assert_close_conditioned(norm.to(dtype), out_s.grad_norm.to(dtype), out_x.grad_norm,
                             f"{kind} global gradient norm", terms=TINY_MODEL_TERMS)
    full = shardzoo.full_state_dict(wrapped)
    reference, exact_state = serial.state_dict(), exact.state_dict()
    assert set(full) == set(reference), f"names differ: {sorted(set(full) ^ set(reference))}"
    worst = 0.0
    for name, value in reference.items():
        assert full[name].shape == value.shape, f"{name}: {tuple(full[name].shape)} != {tuple(value.shape)}"
        assert_close_conditioned(full[name], value, exact_state[name], f"{kind} {name} after a step",
                                 terms=TINY_MODEL_TERMS)
        worst = max(worst, (full[name] - value).abs().max().item())
    return {"loss": abs(out_p.loss.item() - out_s.loss.item()), "param": worst}


DOCUMENTS = (5, 11, 1, 15)  # packed lengths: one a single token, one spanning both sp ranks


def check_packed(kind: str, mesh_kwargs: dict, sp_mode: str = "ring") -> None:
    """On every rank: one packed row of :data:`DOCUMENTS` (transformers' format: positions
    restart at 0, each document's first label -100) through a parallelized ``kind`` model
    equals the documents run one by one through the serial model: loss, logits and every
    parameter after one SGD step."""
    import torch.nn.functional as F

    import shardzoo

    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in DOCUMENTS]
    serial = tiny_causal_lm(kind)
    parallel, exact = copy.deepcopy(serial), copy.deepcopy(serial).double()

    def one_by_one(model):  # each document alone; the loss is the mean over every document's targets
        logits = [model(input_ids=d[None]).logits[0] for d in docs]
        loss = sum(F.cross_entropy(lg[:-1], d[1:], reduction="sum") for lg, d in zip(logits, docs))
        loss = loss / sum(len(d) - 1 for d in docs)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
        return loss.detach(), torch.cat(logits).detach()

    (loss_s, logits_s), (loss_x, logits_x) = one_by_one(serial), one_by_one(exact)
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]

    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, sp_mode=sp_mode)
    wrapped = shardzoo.data_parallel(parallel, mesh)  # averages the sp ranks' gradients
    out = wrapped(input_ids=ids, position_ids=positions, labels=labels)
    out.loss.backward()
    with torch.no_grad():
        for p in parallel.parameters():
            p -= p.grad
    logits = shardzoo.gather_logits(parallel, out.logits.detach())
    assert_close_conditioned(out.loss.detach(), loss_s, loss_x, "packed loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(logits[0], logits_s, logits_x, "packed logits", terms=TINY_MODEL_TERMS)
    full, reference, exact_state = shardzoo.full_state_dict(parallel), serial.state_dict(), exact.state_dict()
    for name, value in reference.items():
        assert_close_conditioned(full[name], value, exact_state[name], f"packed {name} after a step",
                                 terms=TINY_MODEL_TERMS)
