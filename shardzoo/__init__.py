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
from shardzoo.parallel import data_parallel, gather_logits, gather_output, lm_loss, parallelize, zero_optimizer

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


def pipeline(model, mesh, *, n_microbatches: int = 4, schedule: str = "1f1b"):
    """Run a pipelined model: ``pipe = shardzoo.pipeline(model, mesh, n_microbatches=4,
    schedule="1f1b")``, then ``loss = pipe.step(input_ids=..., attention_mask=..., labels=...)``
    on every rank (this dp replica's full tensors; the step's global token-mean loss comes back
    on every rank, the gradients stay in the parameters).

    ``model``: a model ``shardzoo.parallelize`` cut into stages on a mesh with pp > 1 (any
    schedule: "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev";
    :func:`shardzoo.parallel.pipelined.pipeline`), or a family's stage built with
    ``stage=(k, n)`` (a list of them for "interleaved_1f1b"; "gpipe", "1f1b" or
    "interleaved_1f1b": :class:`shardzoo.models.pipeline.FamilyPipeline`). Collective."""
    from shardzoo.models.pipeline import FamilyPipeline, StagedModel
    from shardzoo.parallel.pipelined import pipeline as _cut_pipeline

    stages = list(model) if isinstance(model, (list, tuple)) else [model]
    if stages and all(isinstance(m, StagedModel) for m in stages):
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches={n_microbatches!r} must be an int >= 1")
        return FamilyPipeline(stages, mesh, n_microbatches, schedule)
    return _cut_pipeline(model, mesh, n_microbatches=n_microbatches, schedule=schedule)
