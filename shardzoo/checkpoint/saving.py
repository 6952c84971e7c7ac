"""``save``: every rank writes the pieces it owns; rank 0 writes the index and swaps it in.

Steps (each one agreed by all ranks, so a failure anywhere raises everywhere):
1. rank 0 checks the target, creates and locks ``<dir>.tmp-<token>`` (refused while another save
   into ``<dir>`` runs), restores or removes what earlier saves left (atomic.py);
2. every rank offers the valid boxes the writer rule gives it; one all-gather, and every rank
   computes the same write assignment (each distinct piece to the lowest rank offering it);
3. each writing rank streams its pieces into ``shard-<rank>.safetensors`` and fsyncs it;
4. barrier (with the collective timeout); rank 0 writes ``index.json`` last, fsyncs, swaps
   the directory into place. On failure the temp dir is removed and the old checkpoint stays.
"""

from __future__ import annotations

import datetime
import os
import uuid

from torch import nn

from shardzoo.checkpoint import atomic
from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import (FORMAT, INDEX_NAME, VERSION, config_to_json, mesh_layout, own_config, shard_file_name,
                                       write_json_durably)
from shardzoo.checkpoint.optim import merge_metas, optimizer_tensors
from shardzoo.checkpoint.safetensors_io import SafetensorsWriter, dtype_name
from shardzoo.checkpoint.sync import Ranks, describe
from shardzoo.checkpoint.tensors import LocalTensor, is_candidate_writer, model_tensors, volume
from shardzoo.checkpoint.write_assignment import Offer, assign_writes, pieces_of_rank
from shardzoo.layers import replicas
from shardzoo.layers.dp_shard import reshard_fsdp
from shardzoo.layers.replicas import find_mesh
from shardzoo.layers.shard_spec import unwrap_ddp


def save(model: nn.Module, ckpt_dir: str, optimizer=None, *, config=None, layout: dict | None = None,
         check_replicas: bool = True) -> None:
    """Save ``model`` (and ``optimizer``) as a sharded checkpoint in directory ``ckpt_dir``.

    Collective: every rank of the default process group calls it (a plain module in a single
    process needs no process group). Replicated pieces are written once; the previous
    checkpoint at ``ckpt_dir`` is replaced only when the new one is complete.

    Args:
        model: a parallel model (modules with ``.mesh``, parameters with ShardSpecs) or a plain one.
        ckpt_dir: target directory (created; replaced atomically if it holds a checkpoint).
        optimizer: an optimizer over ``model.parameters()`` (e.g. torch AdamW) to save too.
        config: the model config (dict or dataclass), stored in the index and exported as config.json;
            by default the model's own ``model.config`` when it has one (shardzoo's model families,
            transformers models; also under a DDP wrapper's ``.module``).
        layout: extra layout fields to record (default: the model mesh's sizes and tp_mode).
        check_replicas: first compare the copies of every replicated parameter across the
            ranks holding them (layers/replicas.py: one checksum pass and one int64
            all-reduce) and raise, naming them, when they differ: the file would keep one
            rank's copy. False skips it.
    """
    config = own_config(model) if config is None else config
    config_to_json(config)  # a config that cannot be stored fails here, on every rank alike
    mesh = find_mesh(model)
    if check_replicas:
        reshard_fsdp(unwrap_ddp(model))  # compare the pieces the file will hold
        try:
            replicas.check_replicas(unwrap_ddp(model), mesh, f"saving checkpoint {ckpt_dir}")
        except replicas.ReplicaMismatchError as e:  # raised on every rank alike
            raise CheckpointError(str(e)) from e
    timeout = getattr(mesh, "timeout", None) or datetime.timedelta(minutes=10)
    ranks = Ranks(timeout)
    what = f"saving checkpoint {ckpt_dir}"
    error, tmp, token, staging = None, None, uuid.uuid4().hex[:12], None
    if ranks.rank == 0:
        try:
            staging = atomic.prepare(ckpt_dir, token)
            tmp = staging.path
        except Exception as e:
            error = describe(e)
    error, tmp, token = ranks.broadcast((error, tmp, token))
    if error is not None:
        raise CheckpointError(f"{what} failed: {error}")
    try:
        _save_into(model, optimizer, ranks, mesh, tmp, what, config, layout)
        error = None
        if ranks.rank == 0:
            try:
                atomic.commit(staging, ckpt_dir, token)
            except Exception as e:
                error = describe(e)
        ranks.agree(error, what)
    except BaseException:
        atomic.discard(staging)  # rank 0 only (None elsewhere)
        raise


def _local_tensors(model, optimizer) -> tuple[list[tuple[str, LocalTensor]], dict, dict | None, dict]:
    tensors, aliases = model_tensors(model)
    local = [("model", lt) for lt in tensors]
    meta = None
    if optimizer is not None:
        opt_tensors, meta = optimizer_tensors(model, optimizer, tensors)
        local += [("optimizer", lt) for lt in opt_tensors]
    return local, aliases, meta, _serial_shapes(tensors)


def _serial_shapes(tensors: list[LocalTensor]) -> dict[str, list[int]]:
    """Model tensors stored in another shape than the serial model's (a packed layer's weight,
    ShardSpec.serial_shape): name -> the serial shape, which export writes."""
    return {lt.name: list(lt.spec.serial_shape) for lt in tensors
            if lt.spec is not None and lt.spec.serial_shape and tuple(lt.spec.serial_shape) != lt.global_shape}


def _offers(local: list[tuple[str, LocalTensor]], rank: int) -> list[Offer]:
    offers = []
    for section, lt in local:
        if not is_candidate_writer(lt, rank):
            continue
        offsets, shape = lt.valid_box()
        if volume(shape) == 0 and volume(lt.global_shape) > 0:
            continue  # this rank holds only padding rows
        offers.append(Offer(section, lt.name, lt.global_shape, dtype_name(lt.tensor.dtype), offsets, shape))
    return offers


def _write_shard_file(tmp: str, rank: int, local: list[tuple[str, LocalTensor]], mine: set) -> dict | None:
    """Stream this rank's pieces into its shard file; returns the file's and pieces' records."""
    todo = []
    for section, lt in local:
        offsets, shape = lt.valid_box()
        if (section, lt.name, offsets, shape) in mine:
            todo.append((Offer(section, lt.name, lt.global_shape, dtype_name(lt.tensor.dtype), offsets, shape), lt))
    if not todo:
        return None
    name = shard_file_name(rank)
    writer = SafetensorsWriter(os.path.join(tmp, name), [(o.key, lt.tensor.dtype, o.shape) for o, lt in todo],
                               {"format": "pt", "shardzoo": "checkpoint-shard"})
    pieces = []
    try:
        for offer, lt in todo:
            size, crc = writer.write(offer.key, lt.valid_data())
            pieces.append({"section": offer.section, "name": offer.name, "file": name, "key": offer.key,
                           "offsets": list(offer.offsets), "shape": list(offer.shape), "bytes": size, "crc32": crc})
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"file": name, "bytes": writer.total_bytes, "pieces": pieces}


def _save_into(model, optimizer, ranks: Ranks, mesh, tmp: str, what: str, config, layout) -> None:
    error, offers, local, aliases, meta, serial = None, [], [], {}, None, {}
    try:
        local, aliases, meta, serial = _local_tensors(model, optimizer)
        offers = _offers(local, ranks.rank)
    except Exception as e:
        error = describe(e)
    all_offers = ranks.agree(error, what, offers)
    assignments, problems = assign_writes(all_offers)  # the same on every rank
    if problems:
        raise CheckpointError(f"{what} failed:\n" + "\n".join(problems))
    error, written = None, None
    try:
        written = _write_shard_file(tmp, ranks.rank, local, pieces_of_rank(assignments, ranks.rank))
    except Exception as e:
        error = describe(e)
    ranks.barrier()  # every shard is on disk (or its rank failed) before the index is written
    replies = ranks.agree(error, what, (written, aliases, meta, serial))
    error = None
    if ranks.rank == 0:
        try:
            index = _build_index(assignments, replies, mesh, ranks.world, config, layout)
            write_json_durably(os.path.join(tmp, INDEX_NAME), index)
        except Exception as e:
            error = describe(e)
    ranks.agree(error, what)


def _build_index(assignments, replies, mesh, world: int, config, layout) -> dict:
    config_json, config_class = config_to_json(config)
    sections: dict[str, dict] = {"model": {}, "optimizer": {}}
    for (section, name), assignment in assignments.items():
        sections[section][name] = {"dtype": assignment.dtype, "shape": list(assignment.global_shape), "pieces": []}
    files, aliases, metas = {}, {}, []
    for written, rank_aliases, meta, serial in replies:
        aliases.update(rank_aliases)
        for name, shape in serial.items():
            sections["model"][name]["serial_shape"] = shape
        if meta is not None:
            metas.append(meta)
        if written is None:
            continue
        files[written["file"]] = {"bytes": written["bytes"]}
        for piece in written["pieces"]:
            entry = sections[piece.pop("section")][piece.pop("name")]
            entry["pieces"].append(piece)
    for entries in sections.values():
        for entry in entries.values():
            entry["pieces"].sort(key=lambda p: p["offsets"])
    optimizer = None
    if metas:
        optimizer = merge_metas(metas)
        like_param = optimizer.pop("like_param")
        for name, entry in sections["optimizer"].items():
            entry["like_param"] = like_param.get(name, False)
        optimizer["tensors"] = sections["optimizer"]
    return {
        "format": FORMAT, "version": VERSION,
        "layout": {**mesh_layout(mesh, world), **(layout or {})},
        "config": config_json, "config_class": config_class,
        "checksum": "crc32",
        "files": dict(sorted(files.items())),
        "tensors": sections["model"],
        "aliases": aliases,
        "optimizer": optimizer,
    }
