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
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of
from shardzoo.testing.pools import cached_mesh

VOCAB, SEQ, BATCH = 96, 16, 4


def _config(kind: str, **overrides):
    """(class, config) of the tiny ``kind`` model; ``overrides``: config fields (GPT-2's own names
    for gpt2) replacing the defaults."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
    if kind == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**common, **overrides})
    if kind == "qwen2":  # tied embeddings, q / k / v biases
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **{**common, "tie_word_embeddings": True, **overrides})
    if kind == "qwen3":  # per-head q / k norms
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**{**common, **overrides})
    if kind == "gpt2":  # Conv1D weights, q|k|v packed in c_attn, tied embeddings, learned positions
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(**{
            **dict(n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa"), **overrides})
    if kind == "olmo2":  # q / k norms over every head's width
        return transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**{**common, **overrides})
    if kind == "mistral":
        return transformers.MistralForCausalLM, transformers.MistralConfig(**{**common, "sliding_window": 32,
                                                                                 **overrides})
    raise ValueError(f"unknown tiny model {kind!r}; one of llama, qwen2, qwen3, olmo2, mistral, gpt2")


def tiny_causal_lm(kind: str, seed: int = 0, **overrides):
    """A transformers ``*ForCausalLM`` with random weights drawn from ``seed`` (fp32);
    ``overrides``: config fields (see :func:`_config`)."""
    cls, config = _config(kind, **overrides)
    torch.manual_seed(seed)
    return cls(config).float().train()


def padded_batch(seed: int = 0, rows: int = BATCH, seq: int = SEQ, vocab: int = VOCAB,
                 pads: tuple[int, ...] | None = None, side: str = "right") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [rows, seq], labels -100 where the mask is 0. ``pads``:
    padded tokens per row, on the ``side`` ("right" or "left") of each row; None: rows 1 and 3
    right-padded by 4 and 6 tokens (the default batch of 4 x 16)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    pads = pads if pads is not None else tuple({1: 4, 3: 6}.get(r, 0) for r in range(rows))
    for r, n in enumerate(pads):
        if side == "right":
            mask[r, seq - n:] = 0  # n = 0: the empty slice [seq:]
        else:
            mask[r, :n] = 0
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
    result = parallel_step(parallel, mesh, batch, zero=zero, wrap=wrap)
    return assert_step_equal(kind, result, (serial, out_s), (exact, out_x), dp_rows(batch[0].shape[0], mesh),
                             batch[1].bool())


def dp_rows(rows: int, mesh) -> slice:
    """This dp replica's contiguous rows of a global batch of ``rows``."""
    return slice(mesh.dp_rank * rows // mesh.dp_size, (mesh.dp_rank + 1) * rows // mesh.dp_size)


def parallel_step(parallel, mesh, batch, zero: int = 0, wrap: bool = True) -> dict:
    """One SGD step (lr 1) of the parallelized ``parallel`` on this dp replica's rows of ``batch``
    (``wrap``: through ``data_parallel(zero=...)``; else the gradients as ``backward()`` leaves
    them). Returns its loss, gathered logits [rows, S, V], global gradient norm and full state."""
    import shardzoo
    from shardzoo.models.training import global_grad_norm

    wrapped = shardzoo.data_parallel(parallel, mesh, zero=zero) if wrap else parallel
    ids, mask, labels = (t[dp_rows(batch[0].shape[0], mesh)] for t in batch)
    out = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    norm = global_grad_norm(wrapped, mesh)  # each distinct piece once: kv copies and replicas skipped
    optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.SGD, lr=1.0) if wrap else \
        torch.optim.SGD(parallel.parameters(), lr=1.0)
    optimizer.step()
    return {"loss": out.loss.detach(), "logits": shardzoo.gather_logits(parallel, out.logits.detach()),
            "norm": norm, "state": shardzoo.full_state_dict(wrapped)}


def assert_step_equal(what: str, result: dict, serial_run: tuple, exact_run: tuple, rows: slice,
                      real: torch.Tensor) -> dict:
    """Assert a :func:`parallel_step` ``result`` equals the serial step: loss, gathered logits on
    the ``real`` tokens (the global [B, S] mask) of this replica's ``rows``, gradient norm and every
    parameter after the step. ``serial_run`` / ``exact_run``: (model after :func:`_step`, its
    output), in the parallel model's dtype and in float64. Returns the largest differences."""
    (serial, out_s), (exact, out_x) = serial_run, exact_run
    dtype = next(serial.parameters()).dtype
    real = real[rows]
    logits = result["logits"]
    assert logits.shape == out_s.logits[rows].shape, \
        f"{what} gathered logits {tuple(logits.shape)} != serial's {tuple(out_s.logits[rows].shape)}"
    assert_close_conditioned(result["loss"], out_s.loss.detach(), out_x.loss.detach(), f"{what} loss",
                             terms=TINY_MODEL_TERMS, computed_in=dtype)
    assert_close_conditioned(logits[real], out_s.logits[rows][real].detach(), out_x.logits[rows][real].detach(),
                             f"{what} logits", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(result["norm"].to(dtype), out_s.grad_norm.to(dtype), out_x.grad_norm,
                             f"{what} global gradient norm", terms=TINY_MODEL_TERMS)
    full, reference, exact_state = result["state"], serial.state_dict(), exact.state_dict()
    assert set(full) == set(reference), f"names differ: {sorted(set(full) ^ set(reference))}"
    # The step moved each weight by its gradient (lr 1): a weight that starts at 0 and whose
    # gradient cancels to 0 (a q bias when every target's query sees one key) holds rounding
    # noise of the gradients' size, which its own size does not tell (reorder_bound's floor).
    floor = rms_of(p.grad for p in exact.parameters())
    worst = 0.0
    for name, value in reference.items():
        assert full[name].shape == value.shape, f"{name}: {tuple(full[name].shape)} != {tuple(value.shape)}"
        assert_close_conditioned(full[name], value, exact_state[name], f"{what} {name} after a step",
                                 terms=TINY_MODEL_TERMS, floor=floor)
        worst = max(worst, (full[name].double() - value.double()).abs().max().item())
    return {"loss": abs(result["loss"].item() - out_s.loss.item()), "param": worst}


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
