"""The 'patch_embedding' and 'classifier' styles: an image classifier of one's own (conv patches,
cls token, one attention block, the cls token read through 'first_token') equals its serial
twin, loss, logits and every parameter after one SGD step. Its 5 tokens (4 patches + cls) do
not divide over sp=2, so the embedding pads them and the attention must mask the padded key."""

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


class Patches(nn.Module):
    """pixels [b, 3, 8, 8] -> cat(cls, 4 patches) + positions, [b, 5, h] (ViTEmbeddings' names)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(3, hidden, 4, stride=4)
        self.position_embeddings = nn.Parameter(torch.randn(1, 5, hidden))

    def forward(self, pixels):
        patches = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)  # [b, 4, h]
        return torch.cat([self.cls_token.expand(len(pixels), -1, -1), patches], 1) + self.position_embeddings


class FirstToken(nn.Module):
    def forward(self, x):  # [b, s, h] -> [b, h]
        return x[:, 0]


class ImageClassifier(nn.Module):
    """pixels [b, 3, 8, 8] -> class logits [b, 3]."""

    is_causal = False

    def __init__(self, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.num_heads = heads  # made local by parallelize
        self.embeddings, self.ln, self.norm = Patches(hidden), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.pool, self.classifier = FirstToken(), nn.Linear(hidden, 3)

    def forward(self, pixels):
        x = self.embeddings(pixels)
        b, s, _ = x.shape
        h = self.ln(x)
        q, k, v = (p(h).view(b, s, self.num_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))
        return self.classifier(self.pool(self.norm(x)))


PLAN = {"embeddings": "patch_embedding", "ln": "norm", "norm": "norm", "q": "column", "k": "column",
        "v": "column", "o": "row", "pool": "first_token", "classifier": "classifier"}


def check_image_classifier(mesh_kwargs: dict) -> None:
    import shardzoo
    from shardzoo.layers.tensor_layout import layout_of

    torch.manual_seed(0)
    serial = ImageClassifier()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    pixels = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2, 1, 2])

    def step(model, logits):
        return sgd_step(model, F.cross_entropy(logits, labels)), logits.detach()

    (loss_s, logits_s), (loss_x, logits_x) = step(serial, serial(pixels)), step(exact, exact(pixels.double()))
    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, PLAN)
    layout = layout_of(mesh)
    wrapped = shardzoo.data_parallel(parallel, mesh)  # sp ranks' partial gradients, averaged as the loss is
    loss, logits = step(parallel, layout.gather_batch(wrapped(pixels), layout.activation))  # grids: batch rows split
    assert_close_conditioned(loss, loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(logits, logits_s, logits_x, "logits", terms=TINY_MODEL_TERMS)
    assert_params_match(parallel, serial, exact)


LAYOUTS = {"sp2": with_world(sp=2), "tp2-sp2": with_world(tp=2, sp=2), "2d-tp4": with_world(tp=4, tp_mode="2d")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_image_classifier_of_ones_own(layout):
    mesh_kwargs, world = LAYOUTS[layout]
    run_on_ranks(check_image_classifier, world, mesh_kwargs)


def refusals(_) -> list:
    import shardzoo
    from shardzoo.testing.asserts import error_messages

    mesh = cached_mesh(sp=2)
    plans = [{**PLAN, "q": "patch_embedding"}, {**PLAN, "embeddings.patch_embeddings.projection": "classifier"}]
    calls = [lambda plan=plan: shardzoo.parallelize(ImageClassifier(), mesh, plan) for plan in plans]
    calls.append(lambda: shardzoo.parallelize(ImageClassifier(), mesh, PLAN, causal=True))
    return error_messages(calls)


def test_refusals():
    not_embeddings, not_linear, causal = run_on_ranks(refusals, 2, None)[0]
    assert "q (Linear) a 'patch_embedding', which needs a ViTEmbeddings-like module" in not_embeddings
    assert "a 'classifier' block, which needs an nn.Linear" in not_linear
    assert "cuts its tokens into contiguous chunks, but the model is causal" in causal
