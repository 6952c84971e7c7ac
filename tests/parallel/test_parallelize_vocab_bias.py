"""The 'vocab_bias' style on an encoder of one's own, split by ``shardzoo.parallelize``: a
masked-LM head tied to the token table with an output bias of its own (BERT's), next to a pooler
planned 'first_token' whose output every token gets. Loss, logits and every parameter after one
optimizer step equal the serial model; the refusals name the module and the fix."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.testing import run_on_ranks
from shardzoo.testing.asserts import error_messages
from shardzoo.testing.meshes import with_world
from shardzoo.testing.pools import cached_mesh
from support.user_model import sgd_steps_match

VOCAB, HIDDEN, HEADS, SEQ = 63, 32, 4, 16  # 63 rows: the vocabulary blocks end in padding
PLAN = {
    "embed": "vocab_embedding", "pos": "position_embedding", "ln_*": "norm",
    "attn.q": "column", "attn.k": "column", "attn.v": "column", "attn.o": "row", "fc1": "column", "fc2": "row",
    "pooler": "first_token", "pooler.dense": "dense",
    "mlm": "vocab_bias", "mlm.decoder": "lm_head",
}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HIDDEN // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x, mask=None):  # [b, s, h], bool [b, 1, 1, s] or None -> [b, s, h]
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # bidirectional
        return self.o(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))  # local heads


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2, self.attn = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN), Attention()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class Pooler(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):  # [b, s, h] -> [b, h]
        return torch.tanh(self.dense(x[:, 0]))


class MLMHead(nn.Module):
    """decoder (tied to the token table, no bias) + an output bias of its own, as BERT's."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.decoder = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.decoder.weight = table.weight
        self.bias = nn.Parameter(torch.randn(VOCAB))

    def forward(self, x):  # [b, s, h] -> [b, s, vocab]
        return self.decoder(x) + self.bias


class TinyEncoder(nn.Module):
    """ids [b, s] (padding mask [b, s], 1 = attend) -> MLM logits [b, s, vocab]; every token
    also gets the pooled first token, so the pooler's gradient comes through the logits."""

    is_causal = False

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.pooler, self.mlm = Pooler(), MLMHead(self.embed)

    def forward(self, input_ids, attention_mask=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(input_ids) + self.pos(positions)
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return self.mlm(x + self.pooler(x)[:, None])


def check_encoder(mesh_kwargs: dict, padded: bool) -> bool:
    """On every rank: the parallelized encoder equals its serial twin (loss, logits, every
    parameter after one SGD step)."""
    torch.manual_seed(0)
    serial = TinyEncoder()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (4, SEQ), generator=gen), torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    mask = None
    if padded:
        mask = torch.ones(4, SEQ, dtype=torch.long)
        mask[1, -5:], mask[3, -11:] = 0, 0
        labels[mask == 0] = -100
    sgd_steps_match(serial, exact, parallel, cached_mesh(**mesh_kwargs), PLAN, ids, mask, labels, shift=False)
    return True


LAYOUTS = {  # (mesh, padding mask)
    "1d-tp2-sp2-padded": (with_world(tp=2, sp=2), True),
    "1d-tp4": (with_world(tp=4), False),
    "2d-tp4-sp2-padded": (with_world(tp=4, tp_mode="2d", sp=2), True),
    "3d": (with_world(tp=8, tp_mode="3d"), False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vocab_bias_and_pooler_equal_serial(layout):
    (mesh_kwargs, world), padded = LAYOUTS[layout]
    assert all(run_on_ranks(check_encoder, world, mesh_kwargs, padded))


def refusals() -> list:
    import shardzoo

    mesh = cached_mesh(tp=2)
    no_head = {k: v for k, v in PLAN.items() if k != "mlm.decoder"}
    no_dense = {k: v for k, v in PLAN.items() if k != "pooler.dense"}
    calls = [lambda: shardzoo.parallelize(TinyEncoder(), mesh, {**PLAN, "pooler": "vocab_bias"}),
             lambda: shardzoo.parallelize(TinyEncoder(), mesh, {**no_head, "mlm.decoder": "replicate"}),
             lambda: shardzoo.parallelize(TinyEncoder(), mesh, no_dense)]
    return error_messages(calls)


def test_refusals_name_the_module_and_the_fix():
    no_bias, no_head, uncovered = run_on_ranks(refusals, 2)[0]
    assert "pooler (Pooler) a 'vocab_bias'" in no_bias and "1-d parameter 'bias'" in no_bias
    assert "mlm is planned 'vocab_bias'" in no_head and "Plan the head" in no_head
    # a child of a hooked module is still checked: the pooler's dense must be planned itself
    assert "pooler.dense (Linear) is not in the plan" in uncovered
