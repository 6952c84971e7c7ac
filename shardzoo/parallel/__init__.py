"""``parallelize`` (any model, a plan, any tp layout; docs/parallelize.md), and data parallelism and ZeRO on the mesh's dp axis, from torch's engines (DDP, FSDP2,
ZeroRedundancyOptimizer), composed with every tensor-parallel layout, sp and pipeline stages.

    model = shardzoo.data_parallel(model, mesh, zero=3)         # the model, wrapped in place (every stage)
    opt = shardzoo.zero_optimizer(model, torch.optim.AdamW, lr=1e-3)
    with no_sync(model):                                       # accumulate micro-batches
        ...

See docs/data_parallel.md.
"""

from shardzoo.parallel.inputs import gather_logits, gather_output, lm_loss
from shardzoo.parallel.parallelize import parallelize
from shardzoo.parallel.data_parallel import DataParallelInfo, block_units, data_parallel, ddp_of, info_of
from shardzoo.parallel.zero import no_sync, zero_optimizer
from shardzoo.parallel.pipelined import Pipeline, pipeline

__all__ = ["parallelize", "gather_logits", "gather_output", "lm_loss", "DataParallelInfo", "block_units", "data_parallel", "ddp_of",
           "info_of", "no_sync", "zero_optimizer", "pipeline", "Pipeline"]
