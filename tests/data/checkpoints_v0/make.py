"""Writes the checkpoints of tests/checkpoint/test_ckpt_old_files.py: one tiny model of each
family saved from 1d tp2 by the shardzoo on PYTHONPATH, and its full state as a plain
safetensors file (the values the test expects after loading).

    PYTHONPATH=<an older shardzoo checkout> python tests/data/checkpoints_v0/make.py

The files here were written by the shardzoo whose families built their layers through the
layout object (before they became plain models with plans), so the test checks that such
checkpoints still load.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/, for support.family_configs


def save_family(name: str) -> None:
    import torch
    from safetensors.torch import save_file

    import shardzoo
    from shardzoo import checkpoint
    from shardzoo.comm.mesh_cache import cached_mesh
    from shardzoo.models import spec_named
    from support.family_configs import config_of

    spec = spec_named(name)
    mesh = cached_mesh(tp=2)
    model = spec.model(spec.config(**config_of(name, 1, 37, 24, 0.0)), mesh=mesh, seed=7)
    checkpoint.save(model, os.path.join(HERE, name))
    full = {k: v.contiguous() for k, v in shardzoo.full_state_dict(model).items()}
    if torch.distributed.get_rank() == 0:
        save_file(full, os.path.join(HERE, f"{name}.safetensors"))


if __name__ == "__main__":
    from shardzoo import launch
    from shardzoo.models.spec import family_names

    for family in (sys.argv[1:] or family_names()):
        launch(save_family, 2, family)
