"""index.json: the description of every global tensor of a checkpoint and where its pieces are.

::

    {
      "format": "shardzoo-checkpoint", "version": 1,
      "layout": {"world_size": 4, "dp": 1, "pp": 1, "sp": 1, "tp": 4, "tp_mode": "2d", "tp_depth": 1},
      "config": {...} | null, "config_class": "pkg.module.Config" | null,
      "checksum": "crc32",
      "files": {"shard-00000.safetensors": {"bytes": 123456}, ...},
      "tensors": {"fc1.weight": {"dtype": "float32", "shape": [16, 8], "pieces": [
          {"file": "shard-00000.safetensors", "key": "model/fc1.weight@0,0",
           "offsets": [0, 0], "shape": [8, 4], "bytes": 128, "crc32": 2914236742}, ...]}, ...},
      "aliases": {"head.weight": "embed.weight"},
      (a tensor entry may add "serial_shape": [768, 2304]: the serial model's shape of a tensor
       stored reshaped, e.g. a fused q/k/v weight kept as [in, 3, n]; export writes that shape)
      "optimizer": null | {"class": "AdamW", "param_groups": [{"options": {...}, "params": [names]}],
                           "values": {param: {key: number}}, "tensors": {"fc1.weight/exp_avg": {..., "like_param": true}}}
    }
"""

from __future__ import annotations

import dataclasses
import json
import os

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index_schema import check_index
from shardzoo.checkpoint.jsontypes import load_json_file
from shardzoo.checkpoint.paths import resolve_in
from shardzoo.checkpoint.safetensors_io import write_all, write_error

FORMAT = "shardzoo-checkpoint"
VERSION = 1
INDEX_NAME = "index.json"


def shard_file_name(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def mesh_layout(mesh, world_size: int) -> dict:
    """The layout a checkpoint was saved from (for people and tools; loading ignores it)."""
    if mesh is None:
        return {"world_size": world_size, "dp": world_size, "pp": 1, "sp": 1, "tp": 1, "tp_mode": None, "tp_depth": 1}
    return {"world_size": world_size, "dp": mesh.dp_size, "pp": mesh.pp_size, "sp": mesh.sp_size, "tp": mesh.tp_size,
            "tp_mode": mesh.tp_mode, "tp_depth": mesh.tp_depth}


def own_config(model) -> object | None:
    """``model.config`` (or, under a DDP-style wrapper, ``model.module.config``) when it is a
    config that can be stored: a dataclass instance (shardzoo's families) or an object with
    ``to_dict`` (a transformers config); else None."""
    for holder in (model, getattr(model, "module", None)):
        config = getattr(holder, "config", None)
        if (dataclasses.is_dataclass(config) and not isinstance(config, type)) or hasattr(config, "to_dict"):
            return config
    return None


def config_to_json(config) -> tuple[dict | None, str | None]:
    """(config as a JSON dict, its class path); accepts None, a dict or a dataclass instance."""
    if config is None:
        return None, None
    if hasattr(config, "to_json_string"):  # a transformers config (a dataclass too, in transformers 5): its own
        # JSON, which writes dtype=torch.float32 as "float32" where dataclasses.asdict keeps the torch.dtype
        data = json.loads(config.to_json_string(use_diff=False))
        name = f"{type(config).__module__}.{type(config).__qualname__}"
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        cls = type(config)
        data = dataclasses.asdict(config)
        name = f"{cls.__module__}.{cls.__qualname__}"
    elif isinstance(config, dict):
        data, name = dict(config), None
    elif hasattr(config, "to_dict"):
        data, name = config.to_dict(), f"{type(config).__module__}.{type(config).__qualname__}"
    else:
        raise CheckpointError(f"config must be a dict or a dataclass instance; got {type(config).__name__}. "
                              f"Pass dataclasses.asdict(...) or a plain dict")
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config is not JSON-serialisable ({e}); keep to finite numbers, strings, lists and "
                              f"dicts") from None
    return data, name


def read_index(ckpt_dir: str) -> dict:
    """The parsed and checked index of ``ckpt_dir`` (every field's type and range, the pieces
    against each other: index_schema.py), with errors that name the file, the field and the rule."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist{_aside_hint(ckpt_dir)}")
    path = resolve_in(ckpt_dir, INDEX_NAME, source=f"checkpoint {ckpt_dir}")
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt_dir} has no {INDEX_NAME}, so it is not a complete shardzoo checkpoint "
                              f"(a save that did not finish never writes one); point at a finished checkpoint")
    return check_index(load_json_file(path), path, ckpt_dir, FORMAT, VERSION)


def _aside_hint(ckpt_dir: str) -> str:
    """Where the previous checkpoint is when a save was interrupted with ``ckpt_dir`` moved aside."""
    parent, base = os.path.split(os.path.abspath(ckpt_dir))
    aside = [n for n in os.listdir(parent) if n.startswith(base + ".old-")] if os.path.isdir(parent) else []
    if not aside:
        return ""
    return (f"; a save was interrupted while swapping directories and the previous checkpoint is at "
            f"{os.path.join(parent, aside[0])}: rename it to {ckpt_dir}, or save again (which restores it first)")


def write_json_durably(path: str, data: dict) -> None:
    """Write ``data`` to the new file ``path`` (never through a symlink) and fsync it."""
    raw = json.dumps(data, indent=1, allow_nan=False).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        write_all(fd, raw, path)
        os.fsync(fd)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        os.close(fd)
