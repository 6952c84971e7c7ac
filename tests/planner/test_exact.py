"""The planner's parameter and communication figures are exact: for random small models, every
tp_mode, with sp (ring / Ulysses), pp, dp, activation checkpointing and dropout drawn, the built
model holds ``param_bytes_per_rank`` on its worst rank, and one training step sends what the
planner says on every rank, channel by channel:

* ``counted``: what ``shardzoo.comm.count`` counts (every shardzoo collective and ring send);
* ``ddp``, ``p2p``, ``tied``: DDP's gradient buckets, torch pipelining's stage sends and the
  tied-table all-reduce, which call torch.distributed directly; bench/_measure.py
  counts them with a DDP comm hook and spies on the pp group (see its docstring).

The sum of the channels on the worst rank is ``comm_bytes_per_rank_per_step``. ZeRO stage 1
(DDP + ZeroRedundancyOptimizer's broadcasts, counted in ``ddp``) is checked as stage 0 is;
stages 2 and 3 run FSDP2's own collectives, which nothing here counts. Few examples per world,
on the shared worker pools.
"""

from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardzoo.models.spec import all_specs, family_names, spec_named
from shardzoo.planner.api import plan
from shardzoo.planner.evaluate import Candidate, channel_bytes
from _measure import run_layout
from shardzoo.planner.walked import family_shape
from shardzoo.planner.presets import HARDWARE
from shardzoo.testing import run_on_ranks
from support.family_configs import config_of
from shardzoo.testing.meshes import batch_parts

CHANNELS = ("counted", "ddp", "p2p", "tied")
FAMILY_TYPES = tuple(s.model_type for s in all_specs())  # shardzoo plan DIR builds these as shardzoo's families
GRIDS = {  # world -> tp grids that fit it: (tp_mode, tp, tp_depth)
    2: [("1d", 1, 1), ("1d", 2, 1)],
    4: [("1d", 2, 1), ("1d", 4, 1), ("2d", 4, 1)],
    8: [("1d", 2, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)],
}


@st.composite
def specs(draw, world: int):
    """A layout of ``world`` ranks and a tiny model trainable on it."""
    mode, tp, depth = draw(st.sampled_from(GRIDS[world]))
    rest = world // tp
    sp = draw(st.sampled_from([s for s in (1, 2) if rest % s == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2) if (rest // sp) % p == 0]))
    dp = rest // (sp * pp)
    family = draw(st.sampled_from(family_names()))
    if family == "bert" and dp * sp > 1 and pp == 1:  # its unused pooler breaks DDP without find_unused_parameters
        family = "gpt2"
    parts = batch_parts(dict(tp=tp, tp_mode=mode, tp_depth=depth))
    micro = draw(st.sampled_from([2, 4])) if pp > 1 else 1
    return dict(family=family, layout=dict(dp=dp, pp=pp, sp=sp, tp=tp, tp_mode=mode, tp_depth=depth),
                config=config_of(family, draw(st.integers(pp, 3)), draw(st.integers(33, 70)),
                                 draw(st.sampled_from([32, 48])), draw(st.sampled_from([0.0, 0.1]))),
                micro_batches=micro, batch=dp * micro * parts, seq=8, steps=2,
                checkpointing=draw(st.booleans()), sp_mode=draw(st.sampled_from(["ring", "ulysses"])))


def check_exact(spec: dict) -> None:
    measured = run_on_ranks(run_layout, spec["layout"]["dp"] * spec["layout"]["pp"] * spec["layout"]["sp"]
                            * spec["layout"]["tp"], spec)
    shape = family_shape(spec_named(spec["family"]), spec_named(spec["family"]).config(**spec["config"]))
    candidate = Candidate(**spec["layout"], micro_batches=spec["micro_batches"])
    zero = spec.get("zero", 0)
    planned = plan(shape, candidate.world, 1e6, spec["batch"], spec["seq"], hardware=HARDWARE["a100"], dtype="fp32",
                   sp_mode=spec["sp_mode"], zero_stages=(zero,), tp_modes=(candidate.tp_mode,))
    cand = next(c for c in planned if c.layout == candidate.mesh_kwargs()
                and c.micro_batches == candidate.micro_batches
                and c.activation_checkpointing == spec["checkpointing"] and c.zero == zero)
    stages = planned.pricer.stages(candidate)
    totals = []
    for rank, got in enumerate(measured):
        one, step = planned.pricer.traffic(stages[got["stage"]], candidate, got["stage"], spec["checkpointing"], zero)
        want = channel_bytes(one, step, candidate.micro_batches)
        for k in CHANNELS:
            assert got[k] == want[k], f"rank {rank} stage {got['stage']} {k}: sent {got[k]}, planned {want[k]} ({spec})"
        assert got["param_bytes"] == stages[got["stage"]].params * 4, f"rank {rank} parameter bytes ({spec})"
        totals.append(sum((got[k] for k in CHANNELS), Fraction(0)) + want["other"])  # other: ViT's direct count
    assert cand.comm_bytes_per_rank_per_step == max(totals), spec
    assert cand.param_bytes_per_rank == max(r["param_bytes"] for r in measured), spec


def _spec(family, world, mode, tp, depth=1, sp=1, pp=1, micro=1, ckpt=False, sp_mode="ring", dropout=0.0, zero=0):
    dp = world // (tp * sp * pp)
    parts = batch_parts(dict(tp=tp, tp_mode=mode, tp_depth=depth))
    return dict(family=family, layout=dict(dp=dp, pp=pp, sp=sp, tp=tp, tp_mode=mode, tp_depth=depth),
                config=config_of(family, 2, 37, 48, dropout), micro_batches=micro, batch=dp * micro * parts, seq=8,
                steps=2, checkpointing=ckpt, sp_mode=sp_mode, zero=zero)


@settings(max_examples=3, derandomize=True)
@given(specs(2))
@example(_spec("gpt2", 2, "1d", 1, pp=2, micro=2))
@example(_spec("gpt2", 2, "1d", 1, zero=1))
def test_exact_on_2_ranks(spec):
    check_exact(spec)


@settings(max_examples=1, derandomize=True)
@given(specs(4))
@example(_spec("gpt2", 4, "2d", 4, ckpt=True, dropout=0.1))
@example(_spec("opt", 4, "1d", 2, sp=2, sp_mode="ulysses", ckpt=True))
@example(_spec("gpt2", 4, "1d", 1, pp=2, micro=2, zero=1))
@example(_spec("gpt2", 4, "1d", 1, sp=2, pp=2, micro=2))  # the stage hooks run under DDP in a pipeline
def test_exact_on_4_ranks(spec):
    check_exact(spec)


@settings(max_examples=1, derandomize=True)
@given(specs(8))
@example(_spec("bert", 8, "3d", 8, ckpt=True))
@example(_spec("vit", 8, "2.5d", 8, depth=2))
@example(_spec("gpt2", 8, "2d", 4, pp=2, micro=2, ckpt=True))
def test_exact_on_8_ranks(spec):
    check_exact(spec)


@pytest.mark.parametrize("mode, depth", [("2d", 1), ("2.5d", 2)], ids=["2d", "2.5d"])
def test_opt_grid_checkpointing_recomputes_fc2(mode, depth):
    """OPT's fc2 reads ReLU's saved output and saves no bytes of its own, yet it still packs a
    tensor for backward, so checkpointing recomputes its SUMMA forward: the plan counts it."""
    spec = _spec("opt", 4 * depth, mode, 4 * depth, depth=depth, ckpt=True)
    spec["config"] = config_of("opt", 1, 33, 32, 0.0)
    spec["batch"] = 2 * depth
    check_exact(spec)


# -- a transformers model priced by walking its modules (planner/walk.py) ----------------------
def tiny_llama(kv_heads: int = 2, bias: bool = False) -> dict:
    """LlamaConfig fields of a tiny grouped-query Llama: 8 heads of 8 features, 2 blocks."""
    return dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=kv_heads, intermediate_size=96,
                num_hidden_layers=2, vocab_size=101, max_position_embeddings=64, attention_bias=bias,
                tie_word_embeddings=False)


# a tiny transformers GPT-2: tied table, packed q|k|v Conv1D, learned positions, dropout 0.1
TINY_GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0)


def _hf_spec(world, mode, tp, sp=1, ckpt=False, sp_mode="ring", zero=0, config=None, model_type="llama", pp=1,
             micro=1):
    dp = world // (tp * sp * pp)
    parts = batch_parts(dict(tp=tp, tp_mode=mode, tp_depth=1))
    return dict(hf=dict(model_type=model_type, config=config or tiny_llama()),
                layout=dict(dp=dp, pp=pp, sp=sp, tp=tp, tp_mode=mode, tp_depth=1), micro_batches=micro,
                batch=dp * micro * parts, seq=8, steps=2, checkpointing=ckpt, sp_mode=sp_mode, zero=zero)


def check_hf_exact(spec: dict, directory) -> None:
    """The model's config written as ``save_pretrained`` writes it and planned from that
    directory, as ``shardzoo plan DIR`` plans it (a family's model_type: the model built from
    it, walked); every rank's channels and parameter bytes of a measured step
    (bench/_measure.py, ``spec["hf"]``) equal the plan's, and the ranks' optimizer state adds
    up to the memory model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec["hf"]["model_type"], **spec["hf"]["config"])
    config.save_pretrained(directory)
    candidate, zero = Candidate(**spec["layout"], micro_batches=spec["micro_batches"]), spec["zero"]
    with torch.device("meta"):  # a family's model_type: its directory would build shardzoo's family
        model = AutoModelForCausalLM.from_config(config)
    planned = plan(str(directory) if spec["hf"]["model_type"] not in FAMILY_TYPES else model, candidate.world, 1e6,
                   spec["batch"], spec["seq"], hardware=HARDWARE["a100"], dtype="fp32", sp_mode=spec["sp_mode"],
                   zero_stages=(zero,), tp_modes=(candidate.tp_mode,))
    cand = next(c for c in planned
                if c.layout == candidate.mesh_kwargs() and c.activation_checkpointing == spec["checkpointing"]
                and c.micro_batches == candidate.micro_batches)
    stages = planned.pricer.stages(candidate)  # one per pp rank (parallelize's cut)
    measured = run_on_ranks(run_layout, candidate.world, spec)
    for rank, got in enumerate(measured):
        stage = stages[got["stage"]]
        want = channel_bytes(*planned.pricer.traffic(stage, candidate, got["stage"], spec["checkpointing"], zero),
                             candidate.micro_batches)
        for k in CHANNELS:
            assert got[k] == want[k], f"rank {rank} stage {got['stage']} {k}: sent {got[k]}, planned {want[k]} ({spec})"
        assert got["param_bytes"] == stage.params * 4, f"rank {rank} ({spec})"
    assert cand.param_bytes_per_rank == max(got["param_bytes"] for got in measured), spec
    # the optimizer state, sharded over the ranks ZeRO 1 shards over (dp for a parallelize'd model): on
    # average what the memory model holds per rank (ZeroRedundancyOptimizer splits by whole tensors)
    held = sum(got["optimizer_bytes"] for got in measured)
    states = [planned.pricer.price_variants(candidate, s, k, (spec["checkpointing"],), (zero,))
              for k, s in enumerate(stages)]
    per_rank = candidate.world // candidate.pp
    assert held == sum(m[(spec["checkpointing"], zero)].memory.optimizer for m in states) * per_rank, (held, spec)
    assert cand.comm_bytes_per_rank_per_step == max(sum((got[k] for k in CHANNELS), Fraction(0)) for got in measured)


@pytest.mark.parametrize("spec", [
    _hf_spec(4, "1d", 4, ckpt=True),  # 4 head parts, 2 kv heads: each kv head repeated on 2 ranks
    _hf_spec(4, "1d", 2, sp=2, sp_mode="ulysses", zero=1),  # one kv head per tp rank, sent to both sp ranks
    _hf_spec(4, "1d", 2, sp=2, ckpt=True, config=tiny_llama(bias=True)),  # ring: the kv heads go round
    _hf_spec(4, "2d", 4, config=tiny_llama(kv_heads=1, bias=True)),  # 2 head parts, 1 kv head (and its bias) repeated
    _hf_spec(4, "2d", 4, ckpt=True, config=TINY_GPT2, model_type="gpt2"),
    # backward averages over sp (a counted all-reduce per parameter), DDP and the broadcasts over dp only
    _hf_spec(4, "1d", 1, sp=2, zero=1),
    # cut into stages by parallelize: the first stage enters the sequence chunks, the last leaves them, the chunk is sent
    _hf_spec(4, "1d", 2, pp=2, micro=2, ckpt=True),
    _hf_spec(4, "1d", 1, pp=2, micro=2, zero=1, config=TINY_GPT2, model_type="gpt2"),  # tied table over the stages
], ids=["1d-tp4-gqa-ckpt", "1d-ulysses-zero1", "1d-ring-ckpt-bias", "2d-mqa-bias", "gpt2-2d-ckpt", "dp2-sp2-zero1",
        "pp2-1d-tp2-ckpt", "gpt2-pp2-dp2-zero1"])
def test_exact_for_a_walked_transformers_llama(spec, tmp_path):
    check_hf_exact(spec, tmp_path)
