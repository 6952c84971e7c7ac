"""Point-to-point transfers inside a group, and the async ring exchange of ring attention.

Ranks are group-local everywhere (``dst=1`` is the group's second member). ``send`` / ``recv``
carry shape and dtype in a small header, so the receiver needs to know nothing in advance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardzoo.comm.accounting import record
from shardzoo.comm.ops import global_rank, group_rank, group_size

_MAX_DIMS = 8
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip


def _header(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"send supports tensors of at most {_MAX_DIMS} dims; got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"send does not support dtype {x.dtype}; use one of {_DTYPES}")
    h = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(x.dtype), x.dim()
    h[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    return h


def _check_peer(peer: int, group, what: str) -> None:
    p = group_size(group)
    if not 0 <= peer < p or peer == group_rank(group):
        raise ValueError(f"{what}={peer} must be another rank of the group (0..{p - 1}, not {group_rank(group)})")


def send(x: torch.Tensor, dst: int, group=None) -> None:
    """Send ``x`` (any shape, one of the common dtypes) to group member ``dst``."""
    _check_peer(dst, group, "dst")
    x = x.contiguous()
    peer = global_rank(group, dst)
    header = _header(x).to(x.device)
    dist.send(header, peer, group=group)
    record("send", x.numel() * x.element_size(), group_size(group))
    dist.send(x, peer, group=group)


def recv(src: int, group=None, device: torch.device | str | None = None) -> torch.Tensor:
    """Receive the tensor that group member ``src`` sends; returns it with its shape and dtype."""
    _check_peer(src, group, "src")
    device = torch.device(device) if device is not None else torch.device("cpu")
    peer = global_rank(group, src)
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, peer, group=group)
    h = header.tolist()
    shape = h[2 : 2 + h[1]]
    out = torch.empty(shape, dtype=_DTYPES[h[0]], device=device)
    dist.recv(out, peer, group=group)
    return out


class RingExchange:
    """Send tensors to the next rank of a ring while receiving the same-shaped tensors from
    the previous one, asynchronously (``batch_isend_irecv``), so compute can overlap.

    Usage::

        ring = RingExchange(group)
        pending = ring.start([k, v])   # k, v go to rank+1, new ones come from rank-1
        ...                            # compute on k, v meanwhile
        k, v = pending.wait()

    The ring order is group rank order; ``reverse=True`` sends to rank-1 instead.
    """

    def __init__(self, group=None, reverse: bool = False):
        self.group = group
        self.size = group_size(group)
        me = group_rank(group)
        step = -1 if reverse else 1
        self.next = global_rank(group, (me + step) % self.size)
        self.prev = global_rank(group, (me - step) % self.size)

    def start(self, tensors: list[torch.Tensor]) -> "PendingExchange":
        """Begin sending ``tensors`` onward; returns a handle whose ``wait()`` gives the
        tensors received from the other side (same shapes and dtypes)."""
        if self.size == 1:
            return PendingExchange([], list(tensors))
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        p2p = []
        for s, r in zip(sends, recvs):
            record("send", s.numel() * s.element_size(), self.size)
            p2p.append(dist.P2POp(dist.isend, s, self.next, group=self.group))
            p2p.append(dist.P2POp(dist.irecv, r, self.prev, group=self.group))
        return PendingExchange(dist.batch_isend_irecv(p2p), recvs)

    def swap(self, tensors: list[torch.Tensor], chunk_bytes: int = 4 << 20) -> None:
        """Send ``tensors`` onward and overwrite them with the previous rank's, in place.

        Blocking. Runs in rounds: round i exchanges the i-th piece (at most ``chunk_bytes``) of
        every tensor in one batch, so it holds one piece per tensor of extra memory instead of a
        second copy of every tensor, and small tensors cost one round trip together, not one
        each; each tensor must be contiguous."""
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"RingExchange.swap needs contiguous tensors (it overwrites them in place), got "
                                 f"shape {tuple(t.shape)} with strides {t.stride()}; pass t.contiguous()")
        if self.size == 1:
            return
        flats = [t.view(-1) for t in tensors]
        steps = [max(1, chunk_bytes // t.element_size()) for t in tensors]
        scratch = [torch.empty(min(step, f.numel()), dtype=f.dtype, device=f.device) for f, step in zip(flats, steps)]
        rounds = max((-(-f.numel() // step) for f, step in zip(flats, steps)), default=0)
        for i in range(rounds):
            ops, landed = [], []
            for flat, step, buf in zip(flats, steps, scratch):
                chunk = flat[i * step : (i + 1) * step]
                if chunk.numel() == 0:
                    continue
                incoming = buf[: chunk.numel()]
                record("send", chunk.numel() * chunk.element_size(), self.size)
                ops += [dist.P2POp(dist.isend, chunk, self.next, group=self.group),
                        dist.P2POp(dist.irecv, incoming, self.prev, group=self.group)]
                landed.append((chunk, incoming))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            for chunk, incoming in landed:
                chunk.copy_(incoming)


class PendingExchange:
    """An exchange in flight; ``wait()`` blocks until the received tensors are ready."""

    def __init__(self, works, received: list[torch.Tensor]):
        self._works = works
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for w in self._works:
            w.wait()
        self._works = []
        return self._received
