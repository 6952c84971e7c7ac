"""Token ids outside the vocabulary raise IndexError in every embedding, as nn.Embedding does,
instead of embedding to zeros (a vocabulary-parallel lookup would take them for another rank's
rows): the message names the id, the vocabulary size and the fix. The check is local, so each
case puts the bad id in every row (every rank holds one) and no rank is left in a collective."""

import pytest
import torch

from shardzoo.layers import layout_of
from shardzoo.testing import cached_mesh, run_on_ranks

VOCAB, HIDDEN = 64, 16
GRIDS = {2: [dict(tp=2)], 4: [dict(tp=4, tp_mode="2d")],
         8: [dict(tp=8, tp_mode="3d"), dict(tp=8, tp_mode="2.5d", tp_depth=2)]}


FIXES = {True: "build the model with a vocabulary of at least 101", False: "pass the input ids, not labels"}
EXPECTED = {2: ["VocabParallelEmbedding1D", "Embedding1D"], 4: ["VocabParallelEmbedding2D", "Embedding2D"],
            8: ["VocabParallelEmbedding3D", "Embedding3D", "VocabParallelEmbedding2p5D", "Embedding2p5D"]}


def embeddings_of(mesh):
    """The vocabulary-split and the hidden-split embedding of ``mesh``'s tp_mode."""
    from shardzoo.layers import Embedding1D

    layout = layout_of(mesh)
    hidden = Embedding1D(VOCAB, HIDDEN, mesh=mesh) if mesh.tp_mode == "1d" else layout.embedding(VOCAB, HIDDEN)
    return [layout.vocab_embedding(VOCAB, HIDDEN), hidden]


def bad_ids_case(layouts):
    """Every embedding of ``layouts`` refuses id 100 and id -1; in-range ids still work."""
    seen = []
    for layout in layouts:
        mesh = cached_mesh(**layout)
        tp_layout = layout_of(mesh)
        for emb in embeddings_of(mesh):
            ok = torch.randint(0, VOCAB, (8, 4))
            assert emb(tp_layout.shard_batch(ok)).shape[-1] > 0
            for bad in (100, -1):
                ids = ok.clone()
                ids[:, 1] = bad
                with pytest.raises(IndexError, match=rf"{type(emb).__name__}: token id {bad} is out of range for a "
                                                     rf"vocabulary of {VOCAB} .*\[0, {VOCAB}\).*"
                                                     rf"{FIXES[bad > 0]}"):
                    emb(tp_layout.shard_batch(ids))
            seen.append(type(emb).__name__)
    return seen


@pytest.mark.parametrize("world", sorted(GRIDS))
def test_out_of_range_ids_raise_in_every_layout(world):
    assert run_on_ranks(bad_ids_case, world, GRIDS[world]) == [EXPECTED[world]] * world


def model_ids_case():
    """GPT-2 refuses bad ids in ``shard_input``, where every rank holds the whole batch."""
    from shardzoo.models import GPT2, GPT2Config

    mesh = cached_mesh(sp=2)
    model = GPT2(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16), mesh=mesh, seed=0)
    ids = torch.randint(0, 64, (2, 8))
    ids[1, 5] = 64
    with pytest.raises(IndexError, match="GPT2: token id 64 is out of range for a vocabulary of 64 .* at least 65"):
        model.shard_input(ids)
    return True


def test_model_shard_input_refuses_out_of_range_ids():
    assert all(run_on_ranks(model_ids_case, 2))
