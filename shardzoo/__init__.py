"""shardzoo: parallel transformer building blocks for PyTorch.

Entry points: ``ParallelMesh`` (process groups), ``launch`` (run on N local ranks or under
torchrun), ``shardzoo.comm`` (autograd collectives), ``shardzoo.layers`` (parallel layers and
attention), ``full_state_dict`` (gather any parallel module to serial names and shapes),
``shardzoo.testing`` (worker pools and parallel-vs-serial asserts).
"""

from shardzoo.comm import ParallelMesh, launch
from shardzoo.layers.shard_spec import ShardSpec, full_state_dict

__version__ = "0.1.0"
__all__ = ["ParallelMesh", "launch", "ShardSpec", "full_state_dict", "__version__"]
