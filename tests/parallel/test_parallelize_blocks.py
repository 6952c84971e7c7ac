"""The zoo's ready blocks, ``shardzoo.models.Attention`` and ``MLP`` (the plain modules the
families are built from), composed into a model of one's own and split by
``shardzoo.parallelize`` with a plan naming their projections: loss, logits and every parameter
after one SGD step equal the serial model, with the heads over tp and the sequence over sp."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.models import MLP, Attention
from shardzoo.testing import assert_close_conditioned, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from shardzoo.testing.meshes import with_world
from support.user_model import assert_params_match, sgd_step

PLAN = {
    "embed": "vocab_embedding", "blocks.*.ln_*": "norm",
    "blocks.*.attn.q_proj": "column", "blocks.*.attn.k_proj": "column", "blocks.*.attn.v_proj": "column",
    "blocks.*.attn.out_proj": "row", "blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row",
    "ln_f": "norm", "head": "lm_head",
}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, causal=True)
        self.mlp = MLP(hidden, 4 * hidden, "gelu_new")

    def forward(self, x):  # [b, s, h] -> [b, s, h]
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BlocksLM(nn.Module):
    """ids [b, s] -> logits [b, s, vocab], from the zoo's Attention and MLP blocks."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def check_blocks(mesh_kwargs: dict, sp_mode: str) -> bool:
    import shardzoo

    torch.manual_seed(0)
    serial = BlocksLM()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def serial_loss(model):
        logits = model(ids)
        return logits.detach(), sgd_step(model, F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))

    (logits_s, loss_s), (logits_x, loss_x) = serial_loss(serial), serial_loss(exact)
    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, PLAN, sp_mode=sp_mode)
    wrapped = shardzoo.data_parallel(parallel, mesh) if mesh.sp_size > 1 else parallel
    logits = wrapped(input_ids=ids)
    loss = sgd_step(parallel, shardzoo.lm_loss(parallel, logits, ids))
    assert_close_conditioned(loss, loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(shardzoo.gather_logits(parallel, logits.detach()), logits_s, logits_x, "logits",
                             terms=TINY_MODEL_TERMS)
    assert_params_match(parallel, serial, exact)
    return True


CASES = {
    "1d-tp2-sp2-ring": (with_world(tp=2, sp=2), "ring"),
    "1d-tp2-sp2-ulysses": (with_world(tp=2, sp=2), "ulysses"),
    "2d-tp4": (with_world(tp=4, tp_mode="2d"), "ring"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ready_blocks_split_by_a_plan_equal_serial(case):
    (mesh_kwargs, world), sp_mode = CASES[case]
    assert all(run_on_ranks(check_blocks, world, mesh_kwargs, sp_mode))
