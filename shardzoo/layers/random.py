"""RNG streams for dropout inside and outside a tensor-parallel region (Megatron's tracker,
bound to a mesh instead of a global).

Two streams per process:

* the **default stream** is torch's own generator (CPU, or the current CUDA device). It must
  be the same on every tp rank, so that everything drawn outside the parallel region --
  dropout on replicated activations, initialisation -- is identical across tp ranks and equal
  to what the serial model draws: ``launch`` seeds every rank alike, and ``ParallelMesh``
  gives each tp x sp group its first rank's state when built (``sync_rng=True``).
* the **tp stream** is seeded with ``seed + TP_SEED_OFFSET + tp_rank``, so it differs per tp
  rank. Use it for dropout on activations that are split across tp ranks (attention
  probabilities of local heads, the hidden of a column layer): each rank's shard gets an
  independent mask. The mask for tp > 1 is *not* the slice of the mask serial dropout would
  draw (only the distribution matches); with tp = 1 it is exactly
  ``torch.manual_seed(seed + TP_SEED_OFFSET); F.dropout(x)``.

``with streams.fork("tp"):`` swaps the stream's state into torch's generator for the block and
back out afterwards (as Megatron's ``get_cuda_rng_tracker().fork()``), so any code in the block
-- F.dropout, SDPA dropout -- draws from the stream without taking a generator argument.
Activation checkpointing that recomputes a forked block must save and restore
``streams.get_states()`` around the recomputation, as it does for torch's own state.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.comm.mesh import default_device
from shardzoo.layers.module import ParallelModule

TP_SEED_OFFSET = 2718  # Megatron's offset, so seeds match a Megatron run with the same base seed


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The generator state torch's generator on ``device`` has after ``manual_seed(seed)``."""
    if device.type == "cuda":
        gen = torch.Generator(device=device).manual_seed(seed)
    else:
        gen = torch.Generator().manual_seed(seed)
    return gen.get_state()


class RNGStreams:
    """Named RNG streams of one process for one mesh; ``"tp"`` differs per tp rank.

    Args:
        mesh: the ParallelMesh (its tp rank picks the tp stream's seed).
        seed: base seed; default ``torch.initial_seed()``, i.e. the seed last passed to
            ``torch.manual_seed`` (the same on every rank when the script seeds them alike).
        device: the device whose generator the streams replace; default the mesh's device
            (CUDA under NCCL, else CPU).
    """

    def __init__(self, mesh, seed: int | None = None, *, device: torch.device | str | None = None):
        self.mesh = mesh
        self.device = torch.device(device) if device is not None else default_device(mesh)
        self.seed = int(torch.initial_seed() if seed is None else seed)
        self._states: dict[str, torch.Tensor] = {}
        self.add("tp", self.seed + TP_SEED_OFFSET + mesh.tp_rank)

    def add(self, name: str, seed: int) -> None:
        """Create (or reset) stream ``name`` seeded with ``seed``."""
        self._states[name] = _seeded_state(self.device, int(seed))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's state (to restore them for a recomputation)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states returned by :meth:`get_states`."""
        self._states.update({k: v.clone() for k, v in states.items()})

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Draw from stream ``name`` inside the block; torch's own state is untouched by it."""
        if name not in self._states:
            raise KeyError(f"no RNG stream named {name!r}; streams are {', '.join(self._states)} (add one with .add)")
        outside = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outside)


# the streams are kept on the mesh itself: they refer to their mesh, so a cache keyed weakly by
# the mesh would keep every mesh (and its process groups' threads) alive
_ATTR = "_rng_streams"


def rng_streams(mesh) -> RNGStreams:
    """The streams attached to ``mesh``, created on first use from ``torch.initial_seed()``."""
    streams = mesh.__dict__.get(_ATTR)
    if streams is None:
        streams = mesh.__dict__[_ATTR] = RNGStreams(mesh)
    return streams


def manual_seed(mesh, seed: int) -> RNGStreams:
    """Seed torch's default stream with ``seed`` (same on every rank) and reset the mesh's
    streams from it (tp stream: ``seed + TP_SEED_OFFSET + tp_rank``). Returns the streams."""
    torch.manual_seed(seed)
    streams = mesh.__dict__[_ATTR] = RNGStreams(mesh, seed)
    return streams


def tp_rng(mesh) -> contextlib.AbstractContextManager:
    """``with tp_rng(mesh):`` -- random draws in the block use the per-tp-rank stream."""
    return rng_streams(mesh).fork("tp")


def dropout(
    x: torch.Tensor,
    p: float,
    *,
    mesh,
    parallel_region: bool = True,
    training: bool = True,
    streams: RNGStreams | None = None,
) -> torch.Tensor:
    """``F.dropout(x, p)`` drawing its mask from the tp stream (``parallel_region=True``: ``x``
    is this rank's shard of a tp-split activation) or the default stream (``False``: ``x`` is
    replicated over tp, so every tp rank must drop the same elements). Any shape."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1]")
    if not training or p == 0.0:
        return x
    if not parallel_region:
        return F.dropout(x, p, training=True)
    with (streams or rng_streams(mesh)).fork("tp"):
        return F.dropout(x, p, training=True)


class ParallelDropout(ParallelModule):
    """Dropout module over :func:`dropout`; follows ``module.train()`` / ``.eval()``.

    Args:
        p: drop probability.
        mesh: the ParallelMesh.
        parallel_region: True for tp-split activations (per-rank masks), False for
            activations replicated over tp (identical masks on every tp rank).
        streams: RNG streams to use; default ``rng_streams(mesh)``.
    """

    def __init__(self, p: float = 0.5, *, mesh, parallel_region: bool = True, streams: RNGStreams | None = None):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ParallelDropout p={p} must be in [0, 1]")
        self.p, self.mesh, self.parallel_region, self.streams = p, mesh, parallel_region, streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, mesh=self.mesh, parallel_region=self.parallel_region, training=self.training,
                       streams=self.streams)


    def extra_repr(self) -> str:
        return f"p={self.p}, parallel_region={self.parallel_region}"
