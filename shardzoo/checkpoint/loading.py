"""``load``: fill any model (any mesh, tp_mode, pp, world size, or none) from a checkpoint.

Each rank computes the global box its local tensor covers (from its ShardSpec), finds the saved
pieces that overlap it and reads only those byte ranges (``safe_open(...).get_slice``). The
layout the checkpoint was saved from does not matter. Steps, each agreed by all ranks:
1. read the index, match names and global shapes (missing / unexpected / mis-shaped by name);
2. verify file sizes and piece checksums (see reading.py);
3. read into the parameters, buffers and optimizer state.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import NamedTuple

from torch import nn

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import read_index
from shardzoo.checkpoint.optim import load_optimizer, optimizer_tensors
from shardzoo.checkpoint.reading import PieceReader, entries_of, verify
from shardzoo.checkpoint.sync import Ranks, describe
from shardzoo.checkpoint.tensors import LocalTensor, model_tensors
from shardzoo.layers.replicas import find_mesh


class LoadResult(NamedTuple):
    """Names that were not loaded (only non-empty with ``strict=False``)."""

    missing_keys: list[str]  # in the model, not in the checkpoint (left as they were)
    unexpected_keys: list[str]  # in the checkpoint, in no rank's model


def _match(local: list[LocalTensor], entries: dict, what: str) -> tuple[list[str], list[str], list[str]]:
    """(names found, names missing, shape problems) of this rank's tensors against the index."""
    found, missing, problems = [], [], []
    for lt in local:
        entry = entries.get(lt.name)
        if entry is None:
            missing.append(lt.name)
            continue
        found.append(lt.name)
        if tuple(entry["shape"]) != lt.global_shape and _serial_view(lt, entry) is None:
            problems.append(f"{what} tensor {lt.name!r} has global shape {entry['shape']} in the checkpoint but "
                            f"{list(lt.global_shape)} in the model; build the model with the config the checkpoint "
                            f"was saved with (index.json 'config')")
    return found, missing, problems


def _serial_view(lt: LocalTensor, entry: dict) -> LocalTensor | None:
    """A whole (unsplit) tensor of the serial model's shape, seen in the shape it was saved in
    (the index's ``serial_shape``: e.g. a fused q/k/v weight stored as [in, 3, n] by a parallel
    model, loaded into the serial [in, 3n] one); None when the shapes do not correspond."""
    if lt.spec is not None or tuple(entry.get("serial_shape") or ()) != lt.global_shape:
        return None
    return dataclasses.replace(lt, tensor=lt.tensor.view(entry["shape"]))


def _check_names(index: dict, replies: list, strict: bool, ckpt_dir: str) -> LoadResult:
    problems = sorted({p for _, _, ps in replies for p in ps})
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model:\n" + "\n".join(problems))
    found = {n for names, _, _ in replies for n in names}
    missing = sorted({n for _, ms, _ in replies for n in ms})
    unexpected = [n for n in index["tensors"] if n not in found]
    if strict and (missing or unexpected):
        lines = []
        if missing:
            lines.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing[:20])}")
        if unexpected:
            lines.append(f"in the checkpoint but not in the model ({len(unexpected)}): {', '.join(unexpected[:20])}")
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model:\n" + "\n".join(lines) +
                              "\nBuild the model the checkpoint was saved from, or pass strict=False to load the "
                              "matching tensors and get the rest back as LoadResult")
    return LoadResult(missing, unexpected)


def load(model: nn.Module, ckpt_dir: str, optimizer=None, *, strict: bool = True, verify_checksums: bool = True) -> LoadResult:
    """Load checkpoint ``ckpt_dir`` into ``model`` (and ``optimizer``), resharding as needed.

    Collective when torch.distributed is initialised (every rank calls it). The model may have
    any mesh and layout, or be a plain serial module; each rank reads only the byte ranges of
    the saved pieces that overlap its own (plus its share of the checksum pass). Padding rows
    past a global end are set to zero.

    Args:
        model: the model to fill in place (parameters and persistent buffers).
        ckpt_dir: a directory written by :func:`shardzoo.checkpoint.save`.
        optimizer: an optimizer over ``model.parameters()`` to restore too (same class as saved).
        strict: raise on names missing from the checkpoint or from the model (else report them).
        verify_checksums: check each piece's crc32 (file sizes and headers are always checked).

    Returns:
        LoadResult(missing_keys, unexpected_keys).
    """
    mesh = find_mesh(model)
    ranks = Ranks(getattr(mesh, "timeout", None) or datetime.timedelta(minutes=10))
    what = f"loading checkpoint {ckpt_dir}"
    error, reply, index, local = None, ([], [], []), None, []
    try:
        index = read_index(ckpt_dir)
        local, _ = model_tensors(model)
        reply = _match(local, index["tensors"], "model")
        if optimizer is not None:
            if not index.get("optimizer"):
                raise CheckpointError(f"{ckpt_dir} holds no optimizer state (it was saved without optimizer=...); "
                                      f"call load(..., optimizer=None) and start the optimizer fresh")
            optimizer_tensors(model, optimizer, local)  # every optimizer parameter has a model name
    except Exception as e:
        error = describe(e)
    result = _check_names(index, ranks.agree(error, what, reply), strict, ckpt_dir)

    sections = ("model", "optimizer") if optimizer is not None else ("model",)
    error = None
    try:
        verify(ckpt_dir, index, entries_of(index, sections), ranks.rank, ranks.world, verify_checksums)
    except Exception as e:
        error = describe(e)
    ranks.agree(error, what)

    error = None
    try:
        with PieceReader(ckpt_dir, index) as reader:
            for lt in local:
                entry = index["tensors"].get(lt.name)
                if entry is not None:
                    reader.fill(_serial_view(lt, entry) or lt, entry)
            if optimizer is not None:
                load_optimizer(model, optimizer, index["optimizer"], local, reader.fill)
    except Exception as e:
        error = describe(e)
    ranks.agree(error, what)
    return result
