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

Forks nest. While a fork is open, torch's generator *is* its stream: a fork that opens inside
it first saves that stream's progress, and when the inner fork closes the outer stream goes on
from there. So nesting, and re-entering a stream that is already open further out, draw
exactly what the same forks draw one after the other (each stream moves on, nothing is drawn
twice). ``get_states`` / ``set_states`` read and write the open stream in the generator itself.
The open forks are tracked per generator (one per device and process), not per object or
thread: forks of two meshes' streams nest through the same generator, and a recomputation that
autograd runs on its own thread while the forward thread waits inside a fork nests as well.
Forks must close in the reverse order they opened; one closing early (two threads forking at
once, interleaved generators) raises. Activation checkpointing that recomputes a forked block
saves ``streams.get_states()`` before the block and replays from them (layers/recompute.py,
``stream_contexts``), as it does for torch's own state. docs/tp1d.md has the rules.
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


def _generator_key(device: torch.device) -> str:
    """Which of torch's generators ``device`` uses: the CPU one, or one per CUDA device."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


class _Fork:
    """One open ``RNGStreams.fork``: whose stream, which name."""

    __slots__ = ("streams", "name")

    def __init__(self, streams: "RNGStreams", name: str):
        self.streams, self.name = streams, name


# open forks per generator key, innermost last; the generator holds the innermost one's stream.
# Per generator, not per RNGStreams or thread: the generator itself is shared that widely.
_OPEN: dict[str, list[_Fork]] = {}


def open_forks() -> list[tuple[str, str]]:
    """(generator, stream name) of every fork open now, outermost first."""
    return [(key, f.name) for key, stack in _OPEN.items() for f in stack]


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
        self._seeds: dict[str, int] = {}
        self.add("tp", self.seed + TP_SEED_OFFSET + mesh.tp_rank)

    def add(self, name: str, seed: int, *, reset: bool = False) -> None:
        """Create stream ``name`` seeded with ``seed``; ``reset=True`` re-seeds an existing one.

        Raises ValueError when ``name`` exists and ``reset`` is False (re-seeding must be
        explicit), or when another stream of this object has ``seed`` (the two would draw the
        same masks). Streams of other processes are not checked: ``"tp"`` on tp rank r has
        seed ``self.seed + TP_SEED_OFFSET + r``."""
        seed = int(seed)
        if name in self._states and not reset:
            raise ValueError(f"RNG stream {name!r} exists already (seed {self._seeds.get(name, 'restored')}); pass "
                             f"reset=True to re-seed it with {seed}, or add the new stream under another name")
        for other, used in self._seeds.items():
            if used == seed and other != name:
                raise ValueError(f"RNG stream {name!r} cannot take seed {seed}: stream {other!r} has it, so the two "
                                 f"would draw identical dropout masks; give {name!r} another seed")
        self._seeds[name] = seed
        self._put(name, _seeded_state(self.device, seed))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._states)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's state (to restore them for a recomputation); a stream
        whose fork is open now is read from torch's generator, which holds it."""
        states = {k: v.clone() for k, v in self._states.items()}
        live = self._live()
        if live is not None:
            states[live] = _get_state(self.device)
        return states

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states returned by :meth:`get_states` (an open stream in the generator too)."""
        for name, state in states.items():
            self._put(name, state.clone())

    def _live(self) -> str | None:
        """The name of this object's stream that torch's generator holds now, if any."""
        stack = _OPEN.get(_generator_key(self.device))
        return stack[-1].name if stack and stack[-1].streams is self else None

    def _put(self, name: str, state: torch.Tensor) -> None:
        self._states[name] = state
        if self._live() == name:
            _set_state(self.device, state)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Draw from stream ``name`` inside the block; torch's own state is untouched by it.
        Nested forks (also of the same name) draw what the same forks draw one after the other
        (module docstring); forks must close innermost first."""
        if name not in self._states:
            raise KeyError(f"no RNG stream named {name!r}; streams are {', '.join(self._states)} (add one with .add)")
        stack = _OPEN.setdefault(_generator_key(self.device), [])
        outside = _get_state(self.device)
        if stack:  # the stream open around this fork keeps what it has drawn so far
            around = stack[-1]
            around.streams._states[around.name] = outside
        me = _Fork(self, name)
        stack.append(me)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._close(me, stack, outside)

    def _close(self, me: _Fork, stack: list[_Fork], outside: torch.Tensor) -> None:
        if not stack or stack[-1] is not me:
            inner = stack[-1].name if stack else None
            if any(f is me for f in stack):
                stack[:] = [f for f in stack if f is not me]
            raise RuntimeError(
                f"fork({me.name!r}) closed while fork({inner!r}), opened after it, is still open; forks share "
                f"torch's generator (one per device and process), so they must close innermost first. Do not "
                f"interleave forks from two threads or two generators; nest them")
        self._states[me.name] = _get_state(self.device)
        stack.pop()
        if stack:  # back to the stream open around this fork, where it left off
            _set_state(self.device, stack[-1].streams._states[stack[-1].name])
        else:
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
    streams from it (tp stream: ``seed + TP_SEED_OFFSET + tp_rank``). Returns the streams.
    Raises RuntimeError inside an open fork, whose close would undo the seed."""
    if open_forks():
        key, name = open_forks()[-1]
        raise RuntimeError(f"manual_seed(mesh, {seed}) called inside an open fork of RNG stream {name!r} ({key}): "
                           f"torch's generator holds that stream until the fork closes, and closing it would put "
                           f"back the unseeded state; call manual_seed outside every fork")
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
    """Dropout module over :func:`dropout`; follows ``module.train()`` / ``.eval()``. The plan
    style ``dropout`` replaces an ``nn.Dropout`` with one (parallel/dropouts.py).

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
        # Megatron sequence parallelism (parallel/megatron_sp.py) sets the model's SequenceShards:
        # x is then this rank's chunk of a replicated activation, dropped with that chunk of its mask
        self.sequence = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None and self.training and self.p > 0 and self.sequence.holds_chunk(x):
            return self.sequence.dropout(x, self.p)
        return dropout(x, self.p, mesh=self.mesh, parallel_region=self.parallel_region, training=self.training,
                       streams=self.streams)


    def extra_repr(self) -> str:
        return f"p={self.p}, parallel_region={self.parallel_region}"
