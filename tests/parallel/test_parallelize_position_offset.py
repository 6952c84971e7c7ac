"""The 'position_embedding' style with a row offset: a position table of one's own that looks
position p up in row p + offset (OPT's learned positions start at row 2) equals its serial
twin through ``parallelize`` (loss, logits and every parameter after one SGD step, rows 0..offset-1
untouched), in 1d where the layout keeps the table whole, in 2d where it splits it, and under sp
where the local indices become global ones; a table whose forward computes another index, or
whose offset is no row, is refused."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.testing import cached_mesh, run_on_ranks
from shardzoo.testing.asserts import assert_close_conditioned
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from shardzoo.testing.meshes import with_world
from support.user_model import PLAN, TinyLM

OFFSET = 2


class ShiftedPositions(nn.Embedding):
    """Positions [..., s] (0..S-1) -> rows positions + offset, [..., s, H]."""

    def __init__(self, positions: int, hidden: int, offset: int = OFFSET):
        super().__init__(positions + offset, hidden)
        self.offset = offset

    def forward(self, positions):
        return super().forward(positions + self.offset)


class DoubledPositions(ShiftedPositions):
    """Declares an offset but looks up row 2p + offset: not a shift, so not replaceable."""

    def forward(self, positions):
        return super().forward(2 * positions)


def shifted_lm(table=ShiftedPositions, **kwargs) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    model.pos = table(16, 32, **kwargs)
    return model


def check_shifted_lm(mesh_kwargs: dict) -> None:
    import shardzoo

    serial = shifted_lm()
    exact, parallel = copy.deepcopy(serial).double(), copy.deepcopy(serial)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))

    def step(model, logits, loss):
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
        return logits.detach(), loss.detach()

    def serial_step(model):
        logits = model(ids)
        return step(model, logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))

    (logits_s, loss_s), (logits_x, loss_x) = serial_step(serial), serial_step(exact)
    mesh = cached_mesh(**mesh_kwargs)
    shardzoo.parallelize(parallel, mesh, PLAN)
    wrapped = shardzoo.data_parallel(parallel, mesh) if mesh.sp_size > 1 else parallel
    logits = wrapped(input_ids=ids)
    logits, loss = step(parallel, logits, shardzoo.lm_loss(parallel, logits, ids))
    assert_close_conditioned(loss, loss_s, loss_x, "loss", terms=TINY_MODEL_TERMS)
    assert_close_conditioned(shardzoo.gather_logits(parallel, logits), logits_s, logits_x, "logits",
                             terms=TINY_MODEL_TERMS)
    full, exact_state = shardzoo.full_state_dict(parallel), exact.state_dict()
    for name, value in serial.state_dict().items():
        assert_close_conditioned(full[name], value, exact_state[name], f"{name} after a step", terms=TINY_MODEL_TERMS)
    unused = shifted_lm().pos.weight[:OFFSET]
    assert torch.equal(full["pos.weight"][:OFFSET], unused), "rows before the offset were read"


@pytest.mark.parametrize("layout", ["1d-tp2", "2d-tp4", "1d-tp2-sp2"])
def test_shifted_position_table_equals_serial(layout):
    mesh_kwargs, world = {"1d-tp2": with_world(tp=2), "2d-tp4": with_world(tp=4, tp_mode="2d"),
                          "1d-tp2-sp2": with_world(tp=2, sp=2)}[layout]
    run_on_ranks(check_shifted_lm, world, mesh_kwargs)


def refusal(case: str) -> str:
    import shardzoo

    model = shifted_lm(DoubledPositions) if case == "doubled" else shifted_lm()
    if case != "doubled":
        model.pos.offset = {"negative": -1, "not-an-int": 2.0}[case]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as err:
        shardzoo.parallelize(model, cached_mesh(), PLAN)
    assert isinstance(model.pos, ShiftedPositions), "a refused model was changed"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "a refused model was changed"
    return str(err.value)


@pytest.mark.parametrize("case, words", [
    ("doubled", ["pos", "row p + offset", "super().forward(positions + self.offset)", "'embedding'"]),
    ("negative", ["pos.offset = -1", "integer row of position 0", "'embedding'"]),
    ("not-an-int", ["pos.offset = 2.0", "integer row of position 0"]),
])
def test_a_table_that_is_not_shifted_is_refused(case, words):
    message = run_on_ranks(refusal, 1, case)[0]
    for word in words:
        assert word in message, (word, message)
