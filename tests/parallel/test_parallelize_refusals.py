"""What ``parallelize`` refuses, before any weight moves, with a message naming the module,
the rule and the fix."""

import copy

import pytest
import torch
from torch import nn

from shardzoo.testing import cached_mesh, run_on_ranks
from support.user_model import PLAN, Attention, TinyLM


class OnePlusRMSNorm(nn.Module):
    """An RMSNorm of another formula, y = norm(x) * (1 + w) (Gemma's)."""

    def __init__(self, hidden):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.full((hidden,), 0.5)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def _refusal(mesh_kwargs, edit: str):
    import shardzoo

    torch.manual_seed(0)
    model, plan = TinyLM(), dict(PLAN)
    if edit == "uncovered":
        del plan["blocks.*.fc2"]
    elif edit == "wrong-kind":
        plan["blocks.*.ln_1"] = "column"
    elif edit == "no-match":
        plan["blocks.*.mlp.up_proj"] = "column"
    elif edit in ("odd-norm", "odd-norm-bf16"):
        model.ln_f = OnePlusRMSNorm(32)
        plan["ln_f"] = "norm"
        if edit == "odd-norm-bf16":  # the probe judges the formula, not the model's dtype
            model = model.to(torch.bfloat16)
    elif edit == "positions-uncovered":  # 1d keeps token tables whole, but not a table indexed by local positions
        del plan["pos"]
    elif edit == "unknown-head-count":
        model.blocks[0].attn.num_heads_total = 4
    elif edit == "heads":  # 4 heads on 8 parts
        pass
    elif edit == "dropout-uncovered":
        model, plan = TinyLM(dropout=0.1), {p: s for p, s in PLAN.items() if s != "dropout"}
    elif edit == "dropout-wrong-kind":
        plan["blocks.*.fc1"] = "dropout"
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as err:
        shardzoo.parallelize(model, cached_mesh(**mesh_kwargs), plan)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused model was changed"
    assert all(isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding, OnePlusRMSNorm, TinyLM)) or
               type(m).__module__.startswith(("torch", "shardzoo.testing", "support.")) for m in model.modules())
    return str(err.value)


@pytest.mark.parametrize("edit, mesh_kwargs, world, words", [
    ("uncovered", dict(tp=4, tp_mode="2d"), 4, ["blocks.0.fc2", "not in the plan", "add it to the plan"]),
    ("uncovered", dict(tp=2), 2, ["blocks.0.fc2", "'replicate'"]),
    ("wrong-kind", dict(tp=2), 2, ["blocks.0.ln_1", "LayerNorm", "nn.Linear"]),
    ("no-match", dict(tp=2), 2, ["blocks.*.mlp.up_proj", "match no module"]),
    ("odd-norm", dict(tp=2), 2, ["ln_f", "OnePlusRMSNorm", "plain RMSNorm"]),
    ("odd-norm-bf16", dict(tp=2), 2, ["ln_f", "OnePlusRMSNorm", "plain RMSNorm"]),
    ("positions-uncovered", dict(tp=2, sp=2), 4, ["pos (Embedding)", "sp=2", "'position_embedding'"]),
    ("positions-uncovered", dict(tp=4, tp_mode="2d"), 4, ["pos (Embedding)", "not in the plan"]),
    ("unknown-head-count", dict(tp=2), 2, ["blocks.0.attn.num_heads_total", "head count"]),
    ("heads", dict(tp=8), 8, ["4 heads", "4 kv heads", "head parts that work: [1, 2, 4]"]),
    ("dropout-uncovered", dict(tp=2), 2, ["drop (Dropout, p=0.1)", "not in the plan", 'plan it "dropout"']),
    ("dropout-wrong-kind", dict(tp=2), 2, ["blocks.0.fc1", "'dropout'", "nn.Dropout"]),
])
def test_refused_before_any_weight_moves(edit, mesh_kwargs, world, words):
    message = run_on_ranks(_refusal, world, mesh_kwargs, edit)[0]
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def _kv_refusal():
    import transformers

    import shardzoo

    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=3, vocab_size=32)
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError) as err:
        shardzoo.parallelize(model, cached_mesh(tp=2))
    return str(err.value)


def test_tp_that_fits_neither_heads_nor_kv_heads_is_refused():
    pytest.importorskip("transformers", reason="builds a transformers Llama")
    message = run_on_ranks(_kv_refusal, 2)[0]
    for word in ("6 heads", "3 kv heads", "head parts that work: [1, 3, 6]"):
        assert word in message, f"{word!r} missing from: {message}"


class MaskedAttention(Attention):
    """Builds its own causal mask tensor for SDPA, which sp cannot split."""

    def forward(self, x, mask=None):
        s = x.shape[1]
        return super().forward(x, torch.ones(s, s, dtype=torch.bool, device=x.device).tril())


class ManualAttention(Attention):
    """softmax(q k^T) v written out: no SDPA call for sp to reach."""

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        w = (q @ k.transpose(-1, -2) / self.head_dim ** 0.5).masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, s, -1))


def _sdpa_refusal(edit: str):
    from torch.overrides import _get_current_function_mode

    import shardzoo

    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        block.attn.__class__ = {"attn-mask": MaskedAttention, "no-sdpa": ManualAttention}.get(edit, Attention)
    shardzoo.parallelize(model, cached_mesh(sp=2), PLAN, causal=edit != "not-causal")
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises((ValueError, RuntimeError)) as err:
        model(input_ids=ids)
    assert _get_current_function_mode() is None, "the sdpa mode stayed entered after a failed forward"
    return str(err.value)


@pytest.mark.parametrize("edit, words", [
    ("attn-mask", ["TinyLM under sp=2", "attn_mask", "attention_mask= of the parallelized model"]),
    ("no-sdpa", ["TinyLM", "without calling torch.nn.functional.scaled_dot_product_attention", "sp=1"]),
    ("not-causal", ["causal scaled_dot_product_attention", "causal=True"]),
])
def test_sequence_parallel_module_of_ones_own_refuses_what_it_cannot_split(edit, words):
    message = run_on_ranks(_sdpa_refusal, 2, edit)[0]
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def _mode_as_context():
    import torch.nn.functional as F

    import shardzoo
    from shardzoo.parallel.sdpa_mode import sdpa_mode_of

    torch.manual_seed(0)
    model = shardzoo.parallelize(TinyLM(), cached_mesh(sp=2), PLAN)
    ids = torch.randint(0, 64, (2, 16))
    plain = model(input_ids=ids)
    mode = sdpa_mode_of(model)
    q = torch.randn(2, 4, 8, 8)
    with mode:  # a recompute outside the forward: the model's own forward nests inside it
        again = model(input_ids=ids)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert mode.calls == 3, mode.calls  # two blocks, then the call above
    assert torch.equal(plain, again)
    assert mode.depth == 0


def test_sequence_parallel_mode_is_a_reentrant_context():
    run_on_ranks(_mode_as_context, 2)


def _modes_seen():
    import shardzoo
    from torch.overrides import _get_current_function_mode

    model = shardzoo.parallelize(TinyLM(), cached_mesh(sp=2), PLAN)
    seen = {}

    def record(name):
        def hook(module, args):  # returns None: the call's arguments stay as they are
            seen.setdefault(name, type(_get_current_function_mode()).__name__)
        return hook

    for name, module in model.named_modules():
        module.register_forward_pre_hook(record(name))
    model(input_ids=torch.randint(0, 64, (2, 16)))
    return seen


def test_sequence_parallel_mode_is_entered_around_the_attention_only():
    """A mode costs a Python round trip on every torch call it sees: the model's forward, its
    MLPs, norms and head run without it; the attention modules and their projections in it."""
    seen = run_on_ranks(_modes_seen, 2)[0]
    inside = {n for n, mode in seen.items() if mode == "SequenceParallelSDPA"}
    assert inside == {f"blocks.{i}.attn{p}" for i in (0, 1) for p in ("", ".q", ".k", ".v", ".o")}, seen
    assert {seen[n] for n in seen if n not in inside} == {"NoneType"}, seen


def _hf_position_refusal():
    import shardzoo
    from shardzoo.parallel.hf_model import default_plan
    from support.hf_parallel import tiny_causal_lm

    model = tiny_causal_lm("gpt2")
    plan = {**default_plan(model), "transformer.wpe": "position_embedding"}
    with pytest.raises(ValueError) as err:
        shardzoo.parallelize(model, cached_mesh(sp=2), plan)
    return str(err.value)


def test_position_embedding_style_on_a_transformers_model_under_sp_is_refused():
    """transformers models get global position_ids from the input hook: a second mapping is refused.
    (The default plan's 'wpe', overridden by the longer 'transformer.wpe', is not an unused entry.)"""
    pytest.importorskip("transformers", reason="builds a transformers GPT-2")
    message = run_on_ranks(_hf_position_refusal, 2)[0]
    assert "transformer.wpe" in message and "plan it 'embedding'" in message, message


def _ulysses_heads_refusal():
    import shardzoo
    from support.hf_parallel import tiny_causal_lm

    model = tiny_causal_lm("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=8)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as err:
        shardzoo.parallelize(model, cached_mesh(sp=2), sp_mode="ulysses")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return str(err.value)


def test_ulysses_heads_sp_does_not_divide_are_refused_by_parallelize():
    """Ulysses gives each sp rank whole heads: 3 heads over sp=2 are refused by parallelize, before
    any weight moves (not at the first forward), naming the heads, sp and the fixes."""
    pytest.importorskip("transformers", reason="builds a transformers Llama")
    message = run_on_ranks(_ulysses_heads_refusal, 2)[0]
    for word in ("model.layers.0.self_attn", "3 q heads", "sp=2", "sp_mode='ring'", "(e.g. 4)"):
        assert word in message, f"{word!r} missing from: {message}"


def _column_norm_kv_refusal():
    import shardzoo
    from support.hf_parallel import tiny_causal_lm

    model = tiny_causal_lm("olmo2", hidden_size=32, num_attention_heads=4, num_key_value_heads=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as err:
        shardzoo.parallelize(model, cached_mesh(tp=2))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return str(err.value)


def test_norm_over_kv_heads_the_layout_repeats_is_refused():
    """OLMo2's k_norm spans every kv head: with 1 kv head over tp=2 the layout repeats it, and a
    norm over the split width would count it twice; refused before any weight moves."""
    pytest.importorskip("transformers", reason="builds a transformers OLMo2")
    message = run_on_ranks(_column_norm_kv_refusal, 2)[0]
    for word in ("model.layers.0.self_attn.k_norm", "column_norm", "1 kv heads", "2 head parts"):
        assert word in message, f"{word!r} missing from: {message}"
