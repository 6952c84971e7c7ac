"""Checks that the copies of a replicated tensor agree across the ranks that hold them.

A parameter without a ShardSpec (position table, LayerNorm weights, row biases) is repeated
on every tp and sp rank; under DDP each tp piece is also repeated on every dp replica. The
layers keep those copies equal only when every copy sees the same numbers: the same dropout
masks on replicated activations (the default RNG stream seeded alike, comm/mesh.py) and the
same input on every tp rank. When they drift, nothing fails: a checkpoint keeps one rank's
copy, and the saved model differs from the trained one.

* :func:`check_replicas` (run by ``checkpoint.save`` and ``full_state_dict(...,
  check_replicas=True)``): one exact checksum per parameter piece, all of them in one int64
  all-reduce of ``ranks x parameters`` over the stage's ranks, so a mismatch names the
  parameter and the ranks.
* :func:`check_same_input` (``model.shard_input`` in debug mode, ``SHARDZOO_DEBUG=1``): every
  tp and sp rank of a dp replica was given the same full batch.

Checksums compare bits, not values within a tolerance: copies that run the same operations
on the same numbers are bit-identical, and any difference means they did not.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.layers.dp_shard import rank_piece
from shardzoo.layers.shard_spec import get_shard_spec

DEBUG_ENV = "SHARDZOO_DEBUG"
_CHUNK = 1 << 20  # 16-bit words per step of the checksum: three int64 temporaries, 24 MiB
_PRIME = 65521  # position weights 1.._PRIME, so swapped words change the sum
_SHOWN = 5  # mismatching parameters spelled out in the error


class ReplicaMismatchError(ValueError):
    """Copies of a replicated tensor differ between ranks."""


def debug_mode() -> bool:
    """Whether the opt-in input checks run: environment variable ``SHARDZOO_DEBUG`` set to 1,
    true, yes or on (read at every call)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar of ``t``'s bits (any shape and dtype; same device): the sum of its 16-bit
    words (bytes for 1-byte dtypes) times their position weight. Integer arithmetic, so the
    result does not depend on the order of the reduction: equal tensors give equal sums on
    any rank, and one flipped bit changes it."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    words = flat.view(torch.int16 if flat.element_size() % 2 == 0 else torch.int8)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device) % _PRIME + 1
        total += (part * weight).sum()  # < 2^15 * 2^16 * 2^20 per chunk: no overflow
    return total


def copy_axes(spec, mesh) -> tuple[str, ...]:
    """Mesh axes over which this rank's piece (``spec``; None: the whole tensor) is repeated:
    every axis but pp and those the spec partitions it over. A piece split over the expert axis
    ep is repeated over edp and tp only (ep and edp take the place of dp and sp)."""
    parted = set(mesh.expand_axes(*spec.partitioned_over)) if spec is not None and spec.partitioned_over else set()
    if parted & {"ep", "edp"}:
        return tuple(a for a in ("edp",) + tuple(mesh.tp_sub_axes) if a not in parted)
    return tuple(a for a in mesh.axis_names if a != "pp" and a not in parted)


def find_mesh(model: nn.Module):
    """The first ``.mesh`` found on ``model`` or its submodules (None for a plain serial model)."""
    for module in model.modules():
        mesh = getattr(module, "mesh", None)
        if mesh is not None:
            return mesh
    return None


def _pieces(model: nn.Module, mesh) -> tuple[list[tuple[str, torch.Tensor | None, tuple[str, ...]]], bool]:
    """(name, this rank's piece or None when it has no other copy, copy axes) of every parameter,
    in ``named_parameters`` order; and False when a piece could not be read (the comparison is
    then skipped on every rank, and the caller's own reading reports the error)."""
    out, ok = [], True
    for name, p in model.named_parameters():
        owner_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        try:
            local, spec = rank_piece(p.detach(), get_shard_spec(owner, leaf), getattr(owner, "mesh", None) or mesh, name)
            axes = copy_axes(spec, mesh)
        except ValueError:
            out.append((name, None, ()))
            ok = False
            continue
        repeated = bool(axes) and mesh.size(*axes) > 1  # mesh.size() of no axes is the world
        out.append((name, local if repeated else None, axes if repeated else ()))
    return out, ok


def _stage_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a != "pp")


def _coords(index: int, axes: tuple[str, ...], mesh) -> dict[str, int]:
    """Coordinates on ``axes`` of the rank at ``index`` of their group (row-major, mesh order)."""
    out = {}
    for a in reversed(axes):
        index, out[a] = divmod(index, mesh.size(a))
    return out


def replica_mismatches(model: nn.Module, mesh=None) -> list[str]:
    """One line per parameter whose copies differ, naming the ranks (collective over the
    world; empty on every rank, or the same lines on every rank of a pipeline stage).

    Each rank puts the checksum of each of its pieces in its row of a [ranks of the stage,
    parameters] int64 matrix and one all-reduce sums it (over the world when pp = 1, else over
    the stage's ranks); every rank then compares each parameter within each group of ranks that
    hold the same piece."""
    mesh = mesh or find_mesh(model)
    if mesh is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    stage = _stage_axes(mesh)
    if mesh.size(*stage) == 1:  # pipeline stages only: nothing is repeated within a stage
        return []
    pieces, ok = _pieces(model, mesh)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    table = torch.zeros(mesh.size(*stage), len(pieces) + 1, dtype=torch.int64, device=device)
    row = mesh.rank(*stage)
    table[row, 0] = 0 if ok else 1
    for k, (_, local, _) in enumerate(pieces):
        if local is not None:
            table[row, k + 1] = checksum(local.to(device))
    dist.all_reduce(table, group=None if mesh.pp_size == 1 else mesh.group(*stage))
    if bool(table[:, 0].any()):
        return []
    table = table[:, 1:].cpu()
    ranks = mesh.ranks(*stage)
    coords = [_coords(g, stage, mesh) for g in range(len(ranks))]
    lines = []
    for k, (name, _, axes) in enumerate(pieces):
        if not axes:
            continue
        classes: dict[tuple, list[int]] = {}  # ranks holding the same piece: equal off the copy axes
        for g, coord in enumerate(coords):
            classes.setdefault(tuple(coord[a] for a in stage if a not in axes), []).append(g)
        for members in classes.values():
            values: dict[int, list[int]] = {}
            for g in members:
                values.setdefault(int(table[g, k]), []).append(ranks[g])
            if len(values) > 1:
                split = "; ".join(f"ranks {r} hold one copy" if i == 0 else f"ranks {r} another"
                                  for i, r in enumerate(values.values()))
                over = "x".join(a for a in axes if mesh.size(a) > 1)
                lines.append(f"{name} (replicated over {over}): {split}")
                break  # one group per parameter is enough to name it
    return lines


def check_replicas(model: nn.Module, mesh=None, what: str = "the model") -> None:
    """Raise :class:`ReplicaMismatchError` on every rank when the copies of a replicated
    parameter (or of a tp piece repeated over dp, sp or a 2.5d depth) differ between ranks,
    naming the parameters, the ranks and the likely causes. Collective over the world; cost:
    one checksum pass over every repeated piece and one int64 all-reduce of (ranks of a
    pipeline stage) x (parameters) entries (plus one flag over pp when pp > 1)."""
    mesh = mesh or find_mesh(model)
    lines = replica_mismatches(model, mesh)
    if mesh is not None and mesh.pp_size > 1 and dist.is_initialized():
        flag = torch.tensor([len(lines)], dtype=torch.int64,
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, group=mesh.pp_group)  # every stage raises when one does
        if int(flag) and not lines:
            raise ReplicaMismatchError(f"{what}: copies of a replicated parameter differ on another pipeline stage; "
                                       f"its ranks' errors name it")
    if not lines:
        return
    shown = "\n  ".join(lines[:_SHOWN]) + (f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else "")
    raise ReplicaMismatchError(
        f"{what}: {len(lines)} replicated parameter(s) differ between the ranks that hold copies of them:\n  {shown}\n"
        f"Copies must stay bit-identical; otherwise one rank's copy is saved and the saved model differs from the "
        f"trained one. Likely causes: (1) ranks drew different random numbers outside the tp region (dropout on "
        f"replicated activations): seed every rank alike (torch.manual_seed(seed) on every rank; ParallelMesh aligns "
        f"the tp x sp ranks when built unless sync_rng=False, later per-rank seeding undoes that); (2) the tp or sp "
        f"ranks of a dp replica got different inputs: give them all the same batch (run with {DEBUG_ENV}=1 and "
        f"model.shard_input compares them); (3) dp replicas (DDP) differ: update parameters only through the "
        f"optimizer after shardzoo.data_parallel or average_grads")


def check_same_input(x_full: torch.Tensor, mesh, who: str = "shard_input", fix: str | None = None) -> None:
    """Raise :class:`ReplicaMismatchError` unless every tp and sp rank of this dp replica holds
    the same ``x_full`` (any shape). Collective over those ranks: one int64 all-reduce of
    (tp x sp) entries per sp / tp mesh axis of size > 1 (the axes' own groups, so no group is
    created, and a pipeline's first stage may call it alone). ``fix``: the error's advice
    (default: take each rank's part through shard_input)."""
    axes = tuple(a for a in ("sp",) + mesh.tp_sub_axes if mesh.size(a) > 1)
    if not axes:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else x_full.device
    sums = torch.zeros(mesh.size(*axes), dtype=torch.int64, device=device)
    sums[mesh.rank(*axes)] = checksum(x_full.to(device))
    for a in axes:  # summing over each axis in turn sums over their product
        dist.all_reduce(sums, group=mesh.group(a))
    if bool((sums == sums[0]).all()):
        return
    ranks = mesh.ranks(*axes)
    values: dict[int, list[int]] = {}
    for g, v in enumerate(sums.tolist()):
        values.setdefault(v, []).append(ranks[g])
    split = "; ".join(f"ranks {r}" for r in values.values())
    fix = fix or "take its own part through shard_input"
    raise ReplicaMismatchError(
        f"{who}: the tp / sp ranks of one dp replica were given different inputs of shape {tuple(x_full.shape)} "
        f"(groups of ranks with equal inputs: {split}). Every tp and sp rank must get the same full batch and "
        f"{fix}; feed each dp replica (mesh.dp_rank) its own rows instead, e.g. "
        f"draw the batch with a generator seeded alike on every rank and take batch.chunk(mesh.dp_size)[mesh.dp_rank]")
