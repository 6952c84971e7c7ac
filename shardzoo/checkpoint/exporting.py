"""``export_plain``: a sharded checkpoint -> plain safetensors weights in the Hugging Face layout.

Streams tensor by tensor: each global tensor is assembled from its pieces (padding dropped,
every piece's crc32 checked as it is read), passed through the optional ``rename`` hook and
appended to the current output file, so memory holds about one global tensor at a time.
Output: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` above ``max_shard_bytes``, and ``config.json`` from the
saved config.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

import torch

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import read_index
from shardzoo.checkpoint.reading import PieceReader, entries_of, verify
from shardzoo.checkpoint.safetensors_io import SafetensorsWriter, crc32_of, dtype_from_name, nbytes

Rename = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default shard size ("5GB")


def _plan(index: dict, rename: Rename | None) -> list[tuple[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]]:
    """Per source tensor, the (name, dtype, shape) it exports to: ``rename`` run on meta tensors,
    so the output headers are known before any data is read."""
    plan, seen = [], {}
    for name, entry in index["tensors"].items():
        meta = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]), device="meta")
        try:
            outs = rename(name, meta) if rename is not None else [(name, meta)]
        except Exception as e:
            raise CheckpointError(f"rename({name!r}, tensor) failed on a shape-only (meta) tensor: {type(e).__name__}: {e}. "
                                  f"The hook must use torch ops only (no .item(), .numpy() or data-dependent code)") from e
        row = []
        for out_name, t in outs:
            if out_name in seen:
                raise CheckpointError(f"rename maps both {seen[out_name]!r} and {name!r} to {out_name!r}; output names must be unique")
            seen[out_name] = name
            row.append((out_name, t.dtype, tuple(t.shape)))
        plan.append((name, row))
    return plan


def _split_files(plan, max_shard_bytes: int) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Output tensors grouped into files of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    files, current, size = [], [], 0
    for _, row in plan:
        for out in row:
            n = nbytes(out[2], out[1])
            if current and size + n > max_shard_bytes:
                files.append(current)
                current, size = [], 0
            current.append(out)
            size += n
    files.append(current)
    return files


def _read_full(reader: PieceReader, ckpt_dir: str, name: str, entry: dict) -> torch.Tensor:
    """The whole global tensor, every piece read whole and checked against its crc32."""
    full = torch.zeros(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
    for piece in entry["pieces"]:
        data = reader.handle(piece["file"]).get_tensor(piece["key"])
        if crc32_of(data) != piece["crc32"]:
            raise CheckpointError(f"{os.path.join(ckpt_dir, piece['file'])}: piece {piece['key']!r} of tensor {name!r} "
                                  f"fails its crc32 check: the file is corrupted. Restore it or re-save the checkpoint")
        full[tuple(slice(o, o + s) for o, s in zip(piece["offsets"], piece["shape"]))] = data
    return full


class _Progress:
    """tqdm when it is installed, else a line every ~10% on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self._bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="tensor", desc="export")
            except ImportError:
                pass

    def step(self, name: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"export: {self.done}/{self.total} tensors ({name})", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def export_plain(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 rename: Rename | None = None, progress: bool = True) -> list[str]:
    """Write the model tensors of checkpoint ``ckpt_dir`` as plain safetensors into ``out_dir``.

    One process; memory about one global tensor (plus what ``rename`` makes of it).

    Args:
        ckpt_dir: a checkpoint written by :func:`shardzoo.checkpoint.save`.
        out_dir: output directory (created); existing files of the same names are replaced.
        max_shard_bytes: largest output file before splitting into ``model-0000i-of-0000N``.
        rename: ``rename(name, tensor) -> [(new_name, new_tensor), ...]`` maps a global tensor
            to Hugging Face names / layouts (may split, transpose, drop: return []). It is first
            called on meta tensors to plan the files, so it must use torch ops only.
        progress: show a progress bar (tqdm if installed, else a counter on stderr).

    Returns:
        The paths written.
    """
    index = read_index(ckpt_dir)
    entries = entries_of(index, ("model",))
    verify(ckpt_dir, index, entries, 0, 1, checksums=False)  # sizes now; crc32 as each piece is read
    plan = _plan(index, rename)
    files = _split_files(plan, max_shard_bytes)
    many = len(files) > 1
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" if many else "model.safetensors" for i in range(len(files))]
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    weight_map: dict[str, str] = {}
    bar = _Progress(len(plan), progress)
    file_no, writer, left = -1, None, []
    try:
        with PieceReader(ckpt_dir) as reader:
            for name, row in plan:
                full = _read_full(reader, ckpt_dir, name, index["tensors"][name])
                outs = rename(name, full) if rename is not None else [(name, full)]
                if [(n, t.dtype, tuple(t.shape)) for n, t in outs] != row:
                    raise CheckpointError(f"rename({name!r}) returned {[(n, tuple(t.shape)) for n, t in outs]} on real data "
                                          f"but {[(n, s) for n, _, s in row]} on meta tensors; it must not depend on values")
                for out_name, t in outs:
                    while not left:  # move on to the next output file
                        if writer is not None:
                            writer.close()
                            os.replace(writer.path, writer.path.removesuffix(".partial"))
                        file_no += 1
                        left = list(files[file_no])
                        path = os.path.join(out_dir, names[file_no] + ".partial")
                        writer = SafetensorsWriter(path, left, {"format": "pt"})
                        written.append(os.path.join(out_dir, names[file_no]))
                    left.pop(0)
                    writer.write(out_name, t)
                    weight_map[out_name] = names[file_no]
                bar.step(name)
        if writer is None:  # no tensors at all: still a valid (empty) file
            writer = SafetensorsWriter(os.path.join(out_dir, names[0] + ".partial"), [], {"format": "pt"})
            written.append(os.path.join(out_dir, names[0]))
        writer.close()
        os.replace(writer.path, writer.path.removesuffix(".partial"))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    if many:
        total = sum(nbytes(s, d) for f in files for _, d, s in f)
        path = os.path.join(out_dir, "model.safetensors.index.json")
        with open(path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(path)
    if index.get("config") is not None:
        path = os.path.join(out_dir, "config.json")
        with open(path, "w") as f:
            json.dump(index["config"], f, indent=2)
        written.append(path)
    return written
