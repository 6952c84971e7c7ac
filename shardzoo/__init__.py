"""shardzoo: parallel transformer building blocks for PyTorch.

Entry points: ``ParallelMesh`` (process groups), ``launch`` (run on N local ranks or under
torchrun), ``shardzoo.comm`` (autograd collectives), ``shardzoo.testing`` (worker pools and
parallel-vs-serial asserts).
"""

from shardzoo.comm import ParallelMesh, launch

__version__ = "0.1.0"
__all__ = ["ParallelMesh", "launch", "__version__"]
