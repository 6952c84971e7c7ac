"""Communication: the mesh, autograd-aware collectives, p2p, accounting and the launcher."""

from shardzoo.comm.accounting import CommCounter, count
from shardzoo.comm.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_v,
    broadcast,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter,
    scatter_to,
)
from shardzoo.comm.launch import launch
from shardzoo.comm.mesh import ParallelMesh
from shardzoo.comm.p2p import RingExchange, recv, send
from shardzoo.comm.tp_grids import TP_GRIDS, TP_MODES, TpGrid
from shardzoo.comm.workers import RankTimeoutError, RemoteTraceback, WorkerDiedError, WorkerPool

__all__ = [
    "CommCounter", "count", "all_gather", "all_reduce", "all_to_all", "all_to_all_v", "broadcast", "copy_to",
    "gather_from", "reduce_from", "reduce_scatter", "scatter_to", "launch", "TP_GRIDS", "TP_MODES", "TpGrid",
    "ParallelMesh", "RingExchange", "recv", "send", "RankTimeoutError", "RemoteTraceback",
    "WorkerDiedError", "WorkerPool",
]  # fmt: skip
