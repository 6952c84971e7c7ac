"""Sizes the layouts do not divide, brought the way users bring them: a batch of 1 or 3 on a
grid whose batch parts are 2 or 4, an MLP's inner width of 37 and a vocabulary of 99 on tp 2
and 4 (transformers' own tp tester uses such a tiny Llama). Padding that is exact is applied
and trimmed from every output: loss, gathered logits (their exact shape) and every weight after
one SGD step equal the serial transformers model, and the full tensors keep their own shapes.
"""

import copy

import pytest

pytest.importorskip("transformers", reason="transformers is in the test extra; these tests build its models")

import torch  # noqa: E402

from shardzoo.testing import run_on_ranks  # noqa: E402
from shardzoo.testing.asserts import assert_close_conditioned  # noqa: E402
from shardzoo.testing.dtypes import TINY_MODEL_TERMS  # noqa: E402
from shardzoo.testing.meshes import with_world  # noqa: E402
from shardzoo.testing.pools import cached_mesh  # noqa: E402

SEQ = 12


def tiny_llama(seed: int = 0, kind: str = "Llama", **overrides):
    """A 1-layer transformers ``kind`` causal LM (Llama, Mistral; hidden 32, 4 heads, 2 kv
    heads), fp32, from ``seed``; ``overrides``: its config's fields."""
    import transformers

    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, attn_implementation="sdpa")
    config.update(overrides)
    torch.manual_seed(seed)
    cls, config_cls = getattr(transformers, f"{kind}ForCausalLM"), getattr(transformers, f"{kind}Config")
    return cls(config_cls(**config)).float().train()


def batch_of(rows: int, vocab: int, seq: int = SEQ, seed: int = 0):
    """(ids, mask, labels) [rows, seq]; row 0 right-padded by 3 tokens, labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, seq - 3:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def sgd_step(model, batch):
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return out.loss.detach(), out.logits.detach()


def check_sizes(overrides: dict, mesh_kwargs: dict, rows: int, seq: int = SEQ, sp_mode: str = "ring",
                save_to: str | None = None) -> None:
    """On every rank: loss, gathered logits [rows, seq, V] and every full weight after one SGD
    step of a parallelized tiny Llama equal the serial model's (fp64 bounds fp32's rounding);
    ``save_to``: also ``save_pretrained`` there and load it back with transformers."""
    import shardzoo

    serial = tiny_llama(**overrides)
    parallel, exact = copy.deepcopy(serial), copy.deepcopy(serial).double()
    batch = batch_of(rows, serial.config.vocab_size, seq)
    (loss_s, logits_s), (loss_x, logits_x) = sgd_step(serial, batch), sgd_step(exact, batch)

    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, sp_mode=sp_mode)  # no wrapper: backward() sums over sp itself
    loss, local_logits = sgd_step(parallel, batch)
    logits = shardzoo.gather_logits(parallel, local_logits)
    ids, mask, labels = batch
    assert tuple(logits.shape) == tuple(logits_s.shape), f"gathered logits {tuple(logits.shape)} != serial's " \
                                                         f"{tuple(logits_s.shape)}"
    real = mask.bool()
    assert_close_conditioned(loss, loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(logits[real], logits_s[real], logits_x[real], "logits", terms=TINY_MODEL_TERMS)
    full, reference, exact_state = shardzoo.full_state_dict(parallel), serial.state_dict(), exact.state_dict()
    assert set(full) == set(reference), f"names differ: {sorted(set(full) ^ set(reference))}"
    for name, value in reference.items():
        assert full[name].shape == value.shape, f"{name}: {tuple(full[name].shape)} != {tuple(value.shape)}"
        assert_close_conditioned(full[name], value, exact_state[name], f"{name} after a step", terms=TINY_MODEL_TERMS)
    if save_to is not None:
        import transformers

        shardzoo.save_pretrained(parallel, save_to)
        loaded = transformers.LlamaForCausalLM.from_pretrained(save_to).state_dict()
        for name, value in reference.items():
            assert loaded[name].shape == value.shape, f"saved {name}: {tuple(loaded[name].shape)}"
            assert torch.equal(loaded[name], full[name]), f"saved {name} differs from full_state_dict's"


BATCHES = {  # name: (ParallelMesh kwargs and world, batch rows)
    "2d-tp4-batch1": (with_world(tp=4, tp_mode="2d"), 1),
    "2d-tp4-batch3": (with_world(tp=4, tp_mode="2d"), 3),
    "2.5d-tp8-d2-batch1": (with_world(tp=8, tp_mode="2.5d", tp_depth=2), 1),
    "2.5d-tp8-d2-batch3": (with_world(tp=8, tp_mode="2.5d", tp_depth=2), 3),
}


@pytest.mark.parametrize("case", list(BATCHES))
def test_any_batch_size_equals_serial(case):
    """A batch the grid's batch parts do not divide is padded with rows outside the loss and
    trimmed from the gathered logits."""
    (mesh_kwargs, world), rows = BATCHES[case]
    run_on_ranks(check_sizes, world, {}, mesh_kwargs, rows)


WIDTHS = {  # name: (ParallelMesh kwargs and world, batch rows); MLP inner width 37, vocabulary 99
    "1d-tp2": (with_world(tp=2), 2),
    "1d-tp4": (with_world(tp=4), 3),
    "2d-tp4": (with_world(tp=4, tp_mode="2d"), 3),
    "2.5d-tp8-d2": (with_world(tp=8, tp_mode="2.5d", tp_depth=2), 2),
}


@pytest.mark.parametrize("case", list(WIDTHS))
def test_widths_tp_does_not_divide_equal_serial(case, tmp_path):
    """transformers' tp tester's tiny Llama: intermediate_size=37 and a vocabulary of 99 are
    padded with zeros (exact: padded gate / up rows and down columns add 0, padded logits are
    outside the softmax); full_state_dict and save_pretrained give the unpadded tensors."""
    (mesh_kwargs, world), rows = WIDTHS[case]
    overrides = dict(intermediate_size=37, vocab_size=99)
    run_on_ranks(check_sizes, world, overrides, mesh_kwargs, rows, SEQ, "ring",
                 str(tmp_path / "saved") if case == "1d-tp4" else None)


@pytest.mark.parametrize("sp_mode", ["ring", "ulysses"])
def test_sliding_window_under_sp_equals_serial(sp_mode):
    """Mistral with a window of 5 tokens over a sequence of 16 split over sp=2: every query
    sees its last 5 keys, as the serial model's sliding-window mask."""
    overrides = dict(kind="Mistral", sliding_window=5)
    run_on_ranks(check_sizes, 2, overrides, dict(sp=2), 2, 16, sp_mode)


class _TokenTable(torch.nn.Module):
    """A model of one's own with no 'lm_head': its outputs are the user's to gather."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, input_ids):
        return self.embed(input_ids)


def refused_batch(rows: int) -> str:
    import shardzoo

    model = shardzoo.parallelize(_TokenTable(), cached_mesh(tp=4, tp_mode="2d"), {"embed": "vocab_embedding"})
    with pytest.raises(ValueError) as err:
        model(input_ids=torch.zeros(rows, 4, dtype=torch.long))
    return str(err.value)


def test_batch_padding_refused_without_a_head():
    """Padded rows could not be trimmed from outputs shardzoo does not gather: refused, naming
    the batch and a size that works."""
    message = run_on_ranks(refused_batch, 4, 3)[0]
    assert "a batch of 3 rows" in message and "tp_row=2" in message and "(e.g. 4)" in message, message
