"""shardzoo: parallel transformer building blocks for PyTorch.

Entry points: ``ParallelMesh`` (process groups), ``launch`` (run on N local ranks or under
torchrun), ``shardzoo.comm`` (autograd collectives), ``shardzoo.layers`` (parallel layers and
attention), ``full_state_dict`` (gather any parallel module to serial names and shapes),
``data_parallel`` / ``zero_optimizer`` (DDP and ZeRO 1-3 on the dp axis, ``shardzoo.parallel``),
``shardzoo.testing`` (worker pools and parallel-vs-serial asserts), ``plan`` (the layout planner),
``clip_grad_norm_`` / ``autocast`` (the training helpers of ``shardzoo.models.training``).
"""

from shardzoo.comm import ParallelMesh, launch
from shardzoo.parallel.stage_state import full_state_dict
from shardzoo.layers.shard_spec import ShardSpec
from shardzoo.parallel import data_parallel, gather_logits, gather_output, lm_loss, parallelize, pipeline, zero_optimizer

__version__ = "0.1.0"

# The model families register their checkpoint export adapters on import (checkpoint sits below
# the models and imports none of them), so every entry point of the package finds them.
from shardzoo import models as _models  # noqa: E402,F401
from shardzoo.models.training import autocast, clip_grad_norm_  # noqa: E402  (and shardzoo.models.training)
from shardzoo.models.transformers_io import from_pretrained, save_pretrained  # noqa: E402
__all__ = ["ParallelMesh", "launch", "parallelize", "pipeline", "gather_logits", "gather_output", "lm_loss", "from_pretrained",
           "save_pretrained", "ShardSpec", "full_state_dict", "data_parallel", "zero_optimizer", "plan",
           "clip_grad_norm_", "autocast", "__version__"]


def plan(*args, **kwargs):
    """Every legal layout of a model on a world, priced and sorted (fitting by step time, then
    the rest by peak memory): ``shardzoo.plan(model, world, device_memory_gib, global_batch, seq,
    hardware="h100", nodes=None, devices_per_node=None, top=None, ...)``; see
    :func:`shardzoo.planner.api.plan` and docs/planner.md."""
    from shardzoo.planner.api import plan as _plan

    return _plan(*args, **kwargs)
