"""What an activation-checkpoint recompute must replay besides torch's own RNG state.

``torch.utils.checkpoint`` saves and restores torch's default generator around a recompute,
but not the mesh's tp dropout stream (layers/rng_streams.py), which a block draws from inside
``fork("tp")``; :func:`stream_contexts` saves and replays it.
"""

from __future__ import annotations

import contextlib

from shardzoo.layers.rng_streams import rng_streams


def stream_contexts(mesh):
    """(forward, recompute) context managers for ``torch.utils.checkpoint``'s ``context_fn``:
    the forward one saves the mesh's dropout streams (layers/rng_streams.py), the recompute one
    replays from those states and then puts back the states it found, so the recomputed block
    draws the same dropout masks (Megatron's ``CheckpointFunction`` does the same with its
    tracker) and later draws are unaffected."""
    saved = {}

    @contextlib.contextmanager
    def forward():
        saved.update(rng_streams(mesh).get_states())
        yield

    @contextlib.contextmanager
    def recompute():
        streams = rng_streams(mesh)
        current = streams.get_states()
        streams.set_states(saved)
        try:
            yield
        finally:
            streams.set_states(current)

    return forward(), Reentrant(recompute)


class Reentrant:
    """A context manager made afresh by ``factory`` each time it is entered: a backward split into
    input and weight gradients (the zero-bubble pipeline schedules) recomputes a checkpointed
    block once per part."""

    def __init__(self, factory):
        self.factory, self.entered = factory, []

    def __enter__(self):
        manager = self.factory()
        self.entered.append(manager)
        return manager.__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)
