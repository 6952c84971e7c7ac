"""The planner prices expert parallelism exactly: for a tiny random transformers Mixtral split by
``shardzoo.parallelize`` at ep 2 (world 4, with dp, 1d tp under Megatron sequence parallelism,
ZeRO 0, 1 and 3), one measured training step holds the parameter, gradient and optimizer bytes the
planner gives per rank, and sends what it gives, channel by channel (``shardzoo.comm.count``:
the dispatch's all-to-alls, the edp gradient average, the tp sums; DDP's buckets through a
comm hook). The planner prices the dispatch under uniform routing (each token's top_k copies
spread evenly over the experts), so the step routes uniformly: a forward hook on each router
sends token t to experts t mod E and t + E/2 mod E.

Also: the dispatch bytes against the docs' formula, the candidates' ep values, and the refusals
(experts in a grid layout). The presets' parameter counts: test_walk.py."""

import functools
from fractions import Fraction

import pytest
import torch

from shardzoo.planner.api import plan, price
from shardzoo.planner.enumerate import Problem
from shardzoo.planner.evaluate import Candidate, Pricer, channel_bytes
from shardzoo.planner.presets import HARDWARE, load_model
from shardzoo.testing import cached_mesh, run_on_ranks
from _measure import counting_ddp_hook

WORLD, ROWS, SEQ, EXPERTS = 4, 8, 8, 4
CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
              intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
              tie_word_embeddings=False)


def tiny_mixtral(meta: bool = False):
    import transformers

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG)).float()


def uniform_routing(module, args, output):
    """The router's output with token t sent to experts t mod E and (t + E/2) mod E: with a
    multiple of E tokens each expert gets T K / E of a rank's pairs."""
    logits, weights, index = output
    t = torch.arange(index.shape[0])
    return logits, weights, torch.stack([t % EXPERTS, (t + EXPERTS // 2) % EXPERTS], -1)


def _local_bytes(tensors) -> int:
    """Bytes of this rank's pieces (an FSDP2 DTensor's local shard)."""
    out = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out


def measured_step(layout: dict, zero: int) -> dict:
    """One AdamW step of the tiny Mixtral on this rank of ``layout``: bytes held and sent."""
    import shardzoo
    from shardzoo import comm
    from shardzoo.parallel.data_parallel import ddp_of, info_of

    model = tiny_mixtral()
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(uniform_routing)
    mesh = cached_mesh(**layout)
    shardzoo.parallelize(model, mesh)
    wrapped = shardzoo.data_parallel(model, mesh, zero=zero)
    totals = {"ddp": Fraction(0)}
    if ddp_of(wrapped) is not None:
        ddp_of(wrapped).register_comm_hook((info_of(wrapped).group, totals), counting_ddp_hook)
    ids = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    per = ROWS // mesh.dp_size
    ids = ids[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]
    params = list({id(p): p for p in wrapped.parameters()}.values())
    optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.AdamW, lr=1e-4)
    with comm.count() as counted:
        wrapped(input_ids=ids, labels=ids).loss.backward()
    grads = _local_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    state = [t for entry in optimizer.state.values() for k, t in entry.items() if k != "step"]  # AdamW's moments
    return dict(counted=sum(counted.bytes.values(), Fraction(0)), ddp=totals["ddp"], params=_local_bytes(params),
                grads=grads, optimizer=_local_bytes(state))


@pytest.mark.parametrize("layout, zero", [
    (dict(dp=4, ep=2), 0),  # experts averaged over edp (2 ranks) by their layer, the rest by DDP over dp
    (dict(dp=2, tp=2, tp_mode="1d", ep=2), 0),  # Megatron sequence chunks: router and experts summed over tp
    (dict(dp=4, ep=2), 3),  # FSDP2: the experts sharded over edp, the rest over dp
    (dict(dp=4, ep=2), 1),  # two ZeroRedundancyOptimizers: the experts' state over edp, the rest's over dp
], ids=["dp4-ep2", "dp2-tp2-ep2", "dp4-ep2-zero3", "dp4-ep2-zero1"])
def test_experts_priced_exactly(layout, zero):
    measured = run_on_ranks(functools.partial(measured_step, zero=zero), WORLD, layout)
    candidate = Candidate(**{**dict(dp=1, pp=1, sp=1, tp=1, tp_mode="1d", tp_depth=1), **layout})
    planned = plan(tiny_mixtral(meta=True), WORLD, 1e6, ROWS, SEQ, hardware=HARDWARE["a100"], dtype="fp32",
                   zero_stages=(zero,), tp_modes=("1d",), checkpointing=(False,))
    cand = next(c for c in planned if c.layout == candidate.mesh_kwargs())
    memory = cand.reports[0].memory
    stage = planned.pricer.stages(candidate)[0]
    # what every rank holds: exact per rank at zero 0; FSDP2's shards (dim 0, uneven) and ZeRO 1's partitions
    # (whole parameters, uneven) add up to the ranks' share
    for key, want in (("params", memory.params), ("grads", memory.grads), ("optimizer", memory.optimizer)):
        got = [m[key] for m in measured]
        assert (got == [want] * WORLD) if zero == 0 else sum(got) == want * WORLD, (key, got, want)
    assert cand.param_bytes_per_rank == memory.params
    if zero == 0:  # sent: the counted channel (dispatch, edp average, tp sums, loss) and DDP's buckets
        want = channel_bytes(*planned.pricer.traffic(stage, candidate, 0, False, zero), 1)
        for m in measured:
            assert (m["counted"], m["ddp"]) == (want["counted"], want["ddp"]), (m, want)
        assert cand.comm_bytes_per_rank_per_step == want["counted"] + want["ddp"]


def test_the_dispatch_bytes_follow_the_docs_formula():
    """Per MoE layer and micro-batch: 8 E (ep - 1) / ep for the counts plus 2 H e (s + r) for the
    rows, s = r = T K (ep - 1) / ep under uniform routing (docs/parallelize.md)."""
    problem = Problem(load_model(tiny_mixtral(meta=True)), WORLD, ROWS, SEQ)  # fp32
    for ep in (2, 4):
        [cost] = Pricer(problem, HARDWARE["a100"]).stages(Candidate(4, 1, 1, 1, "1d", 1, ep=ep))
        sent = cost_calls(cost).get(("ep",), Fraction(0))
        tokens, k, h, e = ROWS // 4 * SEQ, 2, CONFIG["hidden_size"], 4
        s = Fraction(tokens * k * (ep - 1), ep)
        layer = 8 * EXPERTS * Fraction(ep - 1, ep) + 2 * h * e * (s + s)
        assert sent == CONFIG["num_hidden_layers"] * layer, (ep, sent)


def cost_calls(cost) -> dict:
    """Bytes of a stage's calls by group axes."""
    from shardzoo.planner.comm import Traffic

    traffic = Traffic()
    for piece in cost.block:
        traffic.add(piece.calls, cost.blocks)
    return traffic.bytes_by(lambda key: key[1])


def test_moe_candidates_list_ep_and_refuse_what_parallelize_refuses():
    planned = plan(tiny_mixtral(meta=True), WORLD, 1e6, ROWS, SEQ, hardware="h100")
    eps = {c.layout.get("ep", 1) for c in planned}
    assert eps == {1, 2, 4}
    assert {c.zero for c in planned if c.layout.get("ep", 1) > 1} == {0, 1, 2, 3}
    assert all(c.layout["tp_mode"] == "1d" for c in planned)
    assert any(c.layout.get("ep", 1) == 2 for c in planned if c.layout["pp"] > 1)  # pipelines with ep
    assert all(c.layout.get("ep", 1) <= c.layout["dp"] * c.layout["sp"] for c in planned)
    one = price(tiny_mixtral(meta=True), WORLD, ROWS, SEQ, "dp=4,ep=2", zero=1)
    zero = price(tiny_mixtral(meta=True), WORLD, ROWS, SEQ, "dp=4,ep=2", zero=0)
    assert one.candidate.reports[0].memory.optimizer < zero.candidate.reports[0].memory.optimizer
    with pytest.raises(ValueError, match="tp_mode='1d'"):
        price(tiny_mixtral(meta=True), WORLD, ROWS, SEQ, "dp=1,tp=4,tp_mode=2d")


class _MoEBlockModel(torch.nn.Module):
    """A module of one's own holding shardzoo's MoEBlock (4 experts of inner width 8, top 2)."""

    def __init__(self):
        from shardzoo.models import MoEBlock

        super().__init__()
        self.embed = torch.nn.Embedding(48, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(16),
                                                               "moe": MoEBlock(16, 8, n_experts=4, top_k=2)})
                                          for _ in range(2))
        self.head = torch.nn.Linear(16, 48, bias=False)

    def forward(self, ids):
        x = self.embed(ids)  # [b, s, H]
        for block in self.blocks:
            x = x + block["moe"](block["norm"](x))
        return self.head(x)  # [b, s, V]


def test_a_moe_block_of_ones_own_is_priced_with_ep():
    from shardzoo.planner.walked import walked_model

    plan_entries = {"embed": "vocab_embedding", "blocks.*.norm": "norm", "head": "lm_head",
                    "blocks.*.moe.experts": "experts", "blocks.*.moe.router": "router"}
    with torch.device("meta"):
        shape = walked_model(_MoEBlockModel(), plan_entries)
    assert shape.n_experts == 4 and [s.top_k for s in shape.walk.block if s.style == "experts"] == [2]
    problem = Problem(shape, WORLD, ROWS, SEQ)
    experts = 2 * 3 * 4 * 8 * 16  # two layers of E I H gate|up and down elements
    for ep in (1, 2, 4):
        [cost] = Pricer(problem, HARDWARE["a100"]).stages(Candidate(4, 1, 1, 1, "1d", 1, ep=ep))
        assert cost.params == shape.parameters - experts + experts // ep
        assert cost.edp_params == (experts // ep if ep > 1 else 0)
        tokens = ROWS // 4 * SEQ
        assert cost.work[0] == 2 * (6 * tokens * 2 * 16 * 8 + 2 * tokens * 16 * 4) + 2 * tokens * 16 * 48


def test_a_shared_expert_is_priced_as_parallelize_builds_it():
    """Qwen2-MoE's shared expert (a column / row pair in a module beside the experts) runs on
    the MoE block's chunk under Megatron sequence parallelism, as parallelize builds it: tp > 1
    is a candidate with sequence parallelism on and off."""
    import transformers

    config = transformers.Qwen2MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                                         intermediate_size=32, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(config)
    planned = plan(model, WORLD, 80, ROWS, SEQ, hardware="a100", tp_modes=("1d",))
    assert {(c.layout["tp"], c.layout.get("ep", 1)) for c in planned} >= {(2, 2), (4, 1)}
    assert not any("sits directly in a MoE block" in p.reason for p in planned.pruned)
    whole = plan(model, WORLD, 80, ROWS, SEQ, hardware="a100", tp_modes=("1d",), sequence_parallel=False)
    assert {(c.layout["tp"], c.layout.get("ep", 1)) for c in whole} >= {(2, 2), (4, 1)}
