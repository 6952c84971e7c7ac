"""shardzoo's plain MoE block (models/moe.py) in a model of one's own, split over ep 2 by a
plan entry 'experts' (and 'router'), equals its serial twin: loss, logits and every weight
after one SGD step (fp32 against the fp64 twin), dp 4 at ep 2."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.testing import assert_close_conditioned, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.moe_init import decided_routing

WORLD, VOCAB, HIDDEN, ROWS, SEQ = 4, 48, 16, 4, 8
PLAN = {"embed": "vocab_embedding", "norms.*": "norm", "norm": "norm", "head": "column",
        "blocks.*.moe.experts": "experts", "blocks.*.moe.router": "router"}


class TinyMoE(nn.Module):
    """Token table, two pre-norm residual MoE blocks (4 experts, top 2), norm, head."""

    def __init__(self):
        from shardzoo.models import MoEBlock

        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(2))
        self.blocks = nn.ModuleList(nn.ModuleDict({"moe": MoEBlock(HIDDEN, 8, n_experts=4, top_k=2)}) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # [b, s, H]
        for norm, block in zip(self.norms, self.blocks):
            x = x + block["moe"](norm(x))
        return self.head(self.norm(x))  # [b, s, V]


def tiny_model() -> TinyMoE:
    torch.manual_seed(0)
    model = TinyMoE()
    return decided_routing(model, "router.weight", expert_std=0.3)


def step(model, ids, targets):
    """Loss (mean over the tokens), logits; then one SGD step (lr 1)."""
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return loss.detach(), logits.detach()


def plain_moe_against_serial(_):
    import shardzoo

    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    serial = tiny_model()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    mesh = cached_mesh(dp=4, ep=2)
    rows = slice(mesh.dp_rank, mesh.dp_rank + 1)
    runs = [step(m, ids, targets) for m in (serial, exact)]
    mine = [(F.cross_entropy(lg[rows].flatten(0, 1), targets[rows].flatten()), lg[rows]) for _, lg in runs]

    shardzoo.parallelize(parallel, mesh, plan=PLAN)
    experts = [m for m in parallel.modules() if type(m).__name__ == "ExpertsEP"]
    assert len(experts) == 2 and all(m.num_experts == 2 for m in experts)
    wrapped = shardzoo.data_parallel(parallel, mesh, zero=0)
    logits = wrapped(ids[rows])
    loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())
    loss.backward()
    shardzoo.zero_optimizer(wrapped, torch.optim.SGD, lr=1.0).step()
    (loss_s, logits_s), (loss_x, logits_x) = mine
    assert_close_conditioned(loss.detach(), loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(logits.detach(), logits_s, logits_x, "logits", terms=TINY_MODEL_TERMS)
    state, s_params, x_params = shardzoo.full_state_dict(wrapped), dict(serial.named_parameters()), \
        dict(exact.named_parameters())
    assert set(state) == set(s_params)
    for name, value in state.items():
        assert_close_conditioned(value, s_params[name].detach(), x_params[name].detach(), f"{name} after the step",
                                 terms=TINY_MODEL_TERMS)


def test_plain_moe_block_at_ep2_equals_serial():
    run_on_ranks(plain_moe_against_serial, WORLD, 0)
