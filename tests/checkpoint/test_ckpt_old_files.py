"""Checkpoints written before the model families became plain models with plans still load:
tests/data/checkpoints_v0 holds one tiny model of each family saved from 1d tp2 by that
shardzoo (make.py there), and the full state it had. Loaded into 2d tp4, every tensor equals it
bit for bit."""

import os

import pytest

from shardzoo.models.spec import family_names
from shardzoo.testing import run_on_ranks

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "checkpoints_v0")


def check_old_checkpoint(family: str) -> None:
    import torch
    from safetensors.torch import load_file

    import shardzoo
    from shardzoo import checkpoint
    from shardzoo.models import spec_named
    from support.family_configs import config_of
    from shardzoo.testing.pools import cached_mesh

    spec = spec_named(family)
    model = spec.model(spec.config(**config_of(family, 1, 37, 24, 0.0)), mesh=cached_mesh(tp=4, tp_mode="2d"),
                       seed=0)
    checkpoint.load(model, os.path.join(DATA, family))
    expected, full = load_file(os.path.join(DATA, f"{family}.safetensors")), shardzoo.full_state_dict(model)
    assert set(full) == set(expected), sorted(set(full) ^ set(expected))
    for name, value in expected.items():
        assert torch.equal(full[name], value), name


@pytest.mark.parametrize("family", family_names())
def test_checkpoint_saved_before_plain_models_loads(family):
    run_on_ranks(check_old_checkpoint, 4, family)
