"""A small transformer written as a user would (plain ``nn.Linear``, ``nn.LayerNorm``,
``nn.Embedding``, SDPA), its plan, and the check that ``parallelize`` splits it exactly.

How such a model takes padding so that it runs serial and parallelized alike: its forward takes
an optional ``attention_mask`` [b, s] (1 = attend) and, when one is given, calls SDPA with
the causal-and-padding ``attn_mask`` it builds; when none is given, ``is_causal=True``. Under
sp the parallelized model hands the mask to shardzoo's attention and calls the forward with
``attention_mask=None``, so SDPA sees no ``attn_mask``, which it could not split.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from shardzoo.testing.pools import cached_mesh

PLAN = {
    "embed": "vocab_embedding", "pos": "position_embedding", "blocks.*.ln_*": "norm",
    "blocks.*.attn.q": "column", "blocks.*.attn.k": "column", "blocks.*.attn.v": "column", "blocks.*.attn.o": "row",
    "blocks.*.fc1": "column", "blocks.*.fc2": "row", "ln_f": "norm", "head": "lm_head",
    "drop": "dropout",  # the embedding's and every block's (a pattern matches from a dot on)
}


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x, mask=None):  # [b, s, h], bool [b, 1, s, s] or None -> [b, s, h]
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # [b, heads, s, d]
        return self.o(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, num_heads)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)  # on each residual branch, as GPT-2's resid_pdrop

    def forward(self, x, mask=None):
        x = x + self.drop(self.attn(self.ln_1(x), mask))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln_2(x)))))


class TinyLM(nn.Module):
    """ids [b, s] (and an optional padding mask [b, s], 1 = attend) -> logits [b, s, vocab];
    ``dropout``: p of the dropout after the embeddings and on each residual branch; ``dense``: a
    projection ``proj`` [h -> h] before the final norm (planned 'dense')."""

    def __init__(self, vocab: int = 64, hidden: int = 32, num_heads: int = 4, layers: int = 2, seq: int = 16,
                 dropout: float = 0.0, dense: bool = False):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, num_heads, dropout) for _ in range(layers))
        self.proj = nn.Linear(hidden, hidden) if dense else None
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None):
        s = input_ids.shape[1]
        positions = torch.arange(s, device=input_ids.device)[None]
        x = self.drop(self.embed(input_ids) + self.pos(positions))
        mask = None
        if attention_mask is not None:  # causal and padding; under sp the attention applies it
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            mask = causal & attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        if self.proj is not None:
            x = torch.tanh(self.proj(x))
        return self.head(self.ln_f(x))


def check_user_model(mesh_kwargs: dict, sp_mode: str = "ring", padded: bool = False, dense: bool = False) -> float:
    """On every rank: a TinyLM parallelized with :data:`PLAN` equals its serial twin (loss,
    logits, every parameter after one SGD step); ``padded``: rows padded on the right, the
    padding mask passed as ``attention_mask``; ``dense``: with the 'dense' projection. Returns
    the largest parameter difference."""
    torch.manual_seed(0)
    serial = TinyLM(dense=dense)
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, -3:] = -100
    mask = None
    if padded:
        mask = torch.ones(4, 16, dtype=torch.long)
        mask[1, -5:], mask[3, -9:] = 0, 0
        labels[mask == 0] = -100
    mesh = cached_mesh(**mesh_kwargs)
    plan = {**PLAN, "proj": "dense"} if dense else PLAN
    return sgd_steps_match(serial, exact, parallel, mesh, plan, ids, mask, labels, shift=True, sp_mode=sp_mode)


def sgd_steps_match(serial: nn.Module, exact: nn.Module, parallel: nn.Module, mesh, plan: dict, ids, mask, labels,
                    shift: bool, sp_mode: str = "ring") -> float:
    """One SGD step (learning rate 1) of ``serial``, its fp64 twin ``exact`` and ``parallel``
    (split here by ``parallelize(parallel, mesh, plan)``) on token ids [b, s] with the padding
    ``mask`` [b, s] (or None) and ``labels`` [b, s] (-100: ignored; ``shift``: a causal LM's
    next-token targets): loss, gathered logits and every parameter after the step equal the
    serial run within the reorder bound at its measured noise. Returns the largest parameter
    difference."""
    import shardzoo

    def serial_step(model):
        logits = model(ids, mask)
        if shift:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return logits.detach(), sgd_step(model, loss)

    (logits_s, loss_s), (logits_x, loss_x) = serial_step(serial), serial_step(exact)
    shardzoo.parallelize(parallel, mesh, plan, sp_mode=sp_mode)
    logits = parallel(input_ids=ids, attention_mask=mask)
    loss = sgd_step(parallel, shardzoo.lm_loss(parallel, logits, labels))
    assert_close_conditioned(loss, loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(shardzoo.gather_logits(parallel, logits.detach()), logits_s, logits_x, "logits",
                             terms=TINY_MODEL_TERMS)
    full, reference, exact_state = shardzoo.full_state_dict(parallel), serial.state_dict(), exact.state_dict()
    assert set(full) == set(reference), sorted(set(full) ^ set(reference))
    for name, value in reference.items():
        assert_close_conditioned(full[name], value, exact_state[name], f"{name} after a step", terms=TINY_MODEL_TERMS)
    return max((full[n] - v).abs().max().item() for n, v in reference.items())


def sgd_step(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Backward ``loss`` and one SGD step of learning rate 1 on ``model``; returns the loss detached."""
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return loss.detach()


def assert_params_match(parallel: nn.Module, serial: nn.Module, exact: nn.Module) -> None:
    """Every parameter of parallelized ``parallel`` (gathered) equals ``serial``'s within the
    serial run's own rounding against the fp64 ``exact`` twin, after a step."""
    import shardzoo

    full, exact_state = shardzoo.full_state_dict(parallel), exact.state_dict()
    for name, value in serial.state_dict().items():
        assert_close_conditioned(full[name], value, exact_state[name], f"{name} after a step", terms=TINY_MODEL_TERMS)


# TinyLM's pipeline plan: its modules in forward order, the blocks the one nn.ModuleList
PP_PLAN = {"embed": (["input_ids"], ["inputs_embeds"]), "pos": (["position_ids"], ["position_embeds"]),
           "drop": (["hidden_states"], ["hidden_states"]), "blocks": (["hidden_states"], ["hidden_states"]),
           "ln_f": (["hidden_states"], ["hidden_states"]), "head": (["hidden_states"], ["logits"])}


def check_user_model_pipeline(mesh_kwargs: dict, schedule: str, layers: int, virtual_stages: int = 1,
                              placement: str = "loop") -> float:
    """On every rank: a TinyLM (whose forward takes ids and a mask only) cut by ``PP_PLAN`` and
    run by ``shardzoo.pipeline`` equals its serial twin: the step's loss and every parameter
    after one SGD step (padding included). Returns the largest parameter difference."""
    import shardzoo

    torch.manual_seed(0)
    serial = TinyLM(layers=layers)
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, -5:], mask[3, -9:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)

    def serial_step(model):
        logits = model(ids, mask)
        return sgd_step(model, F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))

    loss_s, loss_x = serial_step(serial), serial_step(exact)
    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, PLAN, pp_plan=PP_PLAN, virtual_stages=virtual_stages, placement=placement)
    pipe = shardzoo.pipeline(parallel, mesh, n_microbatches=2, schedule=schedule)
    loss = pipe.step(input_ids=ids, attention_mask=mask, labels=labels)
    torch.optim.SGD(parallel.parameters(), lr=1.0).step()
    assert_close_conditioned(loss, loss_s, loss_x, f"{schedule} loss", terms=TINY_MODEL_TERMS)
    full, reference, exact_state = shardzoo.full_state_dict(parallel), serial.state_dict(), exact.state_dict()
    assert set(full) == set(reference), sorted(set(full) ^ set(reference))
    for name, value in reference.items():
        assert_close_conditioned(full[name], value, exact_state[name], f"{schedule} {name} after a step",
                                 terms=TINY_MODEL_TERMS)
    return max((full[n] - v).abs().max().item() for n, v in reference.items())
