"""The 'first_token' style: an encoder of one's own whose pooler reads ``x[:, 0]`` equals its
serial twin under sp (token 0 lives on sp rank 0 only), loss, pooled logits and every
parameter after one SGD step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.testing import run_on_ranks
from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from shardzoo.testing.meshes import with_world
from shardzoo.testing.pools import cached_mesh
from support.user_model import assert_params_match, sgd_step


class Pooler(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):  # [b, s, h] -> [b, h]
        return torch.tanh(self.dense(x[:, 0]))


class Encoder(nn.Module):
    """ids [b, s] -> class logits [b, 3]: embeddings, one bidirectional attention layer, pooler."""

    is_causal = False

    def __init__(self, vocab: int = 32, hidden: int = 16, heads: int = 2, seq: int = 8):
        super().__init__()
        self.num_heads = heads  # made local by parallelize
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.pooler, self.classifier = Pooler(hidden), nn.Linear(hidden, 3)

    def forward(self, input_ids):
        b, s = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(s, device=input_ids.device)[None])
        q, k, v = (p(x).view(b, s, self.num_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))
        return self.classifier(self.pooler(x))


PLAN = {"embed": "vocab_embedding", "pos": "position_embedding", "q": "column", "k": "column", "v": "column",
        "o": "row", "pooler": "first_token", "pooler.dense": "dense", "classifier": "replicate"}


def check_pooled_encoder(mesh_kwargs: dict) -> None:
    import shardzoo

    torch.manual_seed(0)
    serial = Encoder()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2, 1, 2])

    def step(model, logits):
        return sgd_step(model, F.cross_entropy(logits, labels)), logits.detach()

    (loss_s, logits_s), (loss_x, logits_x) = step(serial, serial(ids)), step(exact, exact(ids))
    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, PLAN)
    wrapped = shardzoo.data_parallel(parallel, mesh)  # sp ranks' partial gradients, averaged as the loss is
    loss, logits = step(parallel, wrapped(input_ids=ids))
    assert_close_conditioned(loss, loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(logits, logits_s, logits_x, "pooled logits", terms=TINY_MODEL_TERMS)
    assert_params_match(parallel, serial, exact)


@pytest.mark.parametrize("layout", ["sp2", "tp2-sp2"])
def test_pooler_reads_the_global_first_token(layout):
    mesh_kwargs, world = {"sp2": with_world(sp=2), "tp2": with_world(tp=2), "tp2-sp2": with_world(tp=2, sp=2)}[layout]
    run_on_ranks(check_pooled_encoder, world, mesh_kwargs)
