"""Reading saved pieces: verification of files and checksums, and box reads by byte range.

Verification (before anything is copied into the model):
* every shard file the loaded sections use exists and has exactly the size in the index
  (a truncated or replaced file fails here, on every rank);
* each piece's header entry (dtype, shape, byte size) matches the index, and the crc32 of its
  bytes matches; the pieces are split between the ranks by size, so the checkpoint is read
  once in total for this, not once per rank. ``verify=False`` skips the checksums only.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import INDEX_NAME
from shardzoo.checkpoint.paths import resolve_in, show
from shardzoo.checkpoint.safetensors_io import ST_DTYPES, crc32_of_range, dtype_from_name
from shardzoo.checkpoint.st_header import entries, read_header
from shardzoo.checkpoint.tensors import Box, LocalTensor, fill_local, intersect, relative_slices, volume

_FIX_SENTENCE = "Restore the file from the original save or re-save the checkpoint"


def safetensors_call(path: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` of the safetensors library on file ``path``. The header was checked
    to safetensors' own rules first, so a failure here means the file changed under us: it
    is reported as a CheckpointError naming the file."""
    try:
        return fn(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: safetensors cannot read it ({type(e).__name__}); the file changed while it was "
                              f"read or is corrupted. {_FIX_SENTENCE}") from None


def entries_of(index: dict, sections: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(tensor name, index entry) of the given sections ("model", "optimizer")."""
    out = list(index["tensors"].items()) if "model" in sections else []
    if "optimizer" in sections and index.get("optimizer"):
        out += list(index["optimizer"]["tensors"].items())
    return out


def shard_path(ckpt_dir: str, file: str) -> str:
    """The path of shard file ``file`` (a name from the index), refused if it leaves ``ckpt_dir``."""
    return resolve_in(ckpt_dir, file, source=f"{os.path.join(ckpt_dir, INDEX_NAME)}, files")


def keys_by_file(index: dict) -> dict[str, set[str]]:
    """The piece keys the index places in each shard file (both sections)."""
    out: dict[str, set[str]] = {file: set() for file in index["files"]}
    for _, entry in entries_of(index, ("model", "optimizer")):
        for piece in entry["pieces"]:
            out[piece["file"]].add(piece["key"])
    return out


def shard_header(ckpt_dir: str, file: str, listed: set[str]) -> tuple[str, dict, int]:
    """(path, checked header, data start) of shard file ``file``: its entries must be exactly
    the pieces ``listed`` for it by the index (so a tensor dropped from the index is noticed too)."""
    path = shard_path(ckpt_dir, file)
    header, data_start = read_header(path)
    held = set(entries(header))
    if held != listed:
        extra, lost = sorted(held - listed), sorted(listed - held)
        what = (f"holds {len(extra)} piece(s) the index does not list (e.g. {show(extra[0])})" if extra else
                f"lacks {len(lost)} piece(s) the index places there (e.g. {show(lost[0])})")
        raise CheckpointError(f"{path} {what}; the file and the index do not belong together. {_FIX_SENTENCE}")
    return path, header, data_start


def verify(ckpt_dir: str, index: dict, entries: list[tuple[str, dict]], rank: int, world: int, checksums: bool) -> None:
    """Check sizes of every used file, and headers + crc32 of this rank's share of the pieces
    (the header entry of every piece a rank reads is checked again as it reads it, so
    ``checksums=False`` skips the crc32 pass only)."""
    pieces = [(name, e["dtype"], p) for name, e in entries for p in e["pieces"]]
    for file in sorted({p["file"] for _, _, p in pieces}):
        path = shard_path(ckpt_dir, file)
        expected = index["files"][file]["bytes"]
        if not os.path.isfile(path):
            names = sorted({n for n, _, p in pieces if p["file"] == file})
            raise CheckpointError(f"{path} is missing; the index stores pieces of {len(names)} tensor(s) there "
                                  f"(e.g. {show(names[0])}). {_FIX_SENTENCE}")
        size = os.path.getsize(path)
        if size != expected:
            state = "truncated" if size < expected else "not the file that was saved"
            raise CheckpointError(f"{path} is {size} bytes but the index records {expected}: the file is {state}. "
                                  f"{_FIX_SENTENCE}")
    if not checksums:
        return
    load = [0] * world
    headers: dict[str, tuple[str, dict, int]] = {}
    listed = keys_by_file(index)
    for name, dtype, piece in sorted(pieces, key=lambda x: (-x[2]["bytes"], x[2]["file"], x[2]["key"])):
        owner = min(range(world), key=load.__getitem__)  # largest first to the least-loaded rank
        load[owner] += piece["bytes"]
        if owner != rank:
            continue
        if piece["file"] not in headers:
            headers[piece["file"]] = shard_header(ckpt_dir, piece["file"], listed[piece["file"]])
        path, header, data_start = headers[piece["file"]]
        _check_piece(path, name, dtype, piece, header, data_start)


def piece_range(path: str, name: str, dtype: str, piece: dict, header: dict) -> tuple[int, int]:
    """(start, end) of ``piece``'s bytes in the data section of shard file ``path`` (whose
    checked ``header`` is given), after checking its header entry against the index."""
    info = header.get(piece["key"]) if piece["key"] != "__metadata__" else None
    if info is None:
        raise CheckpointError(f"{path} has no entry for piece {show(piece['key'])} of tensor {show(name)}; the file "
                              f"does not belong to this index. {_FIX_SENTENCE}")
    start, end = info["data_offsets"]
    stored_dtype = ST_DTYPES[dtype_from_name(dtype)]
    differ = [what for what, same in (("dtype", info["dtype"] == stored_dtype), ("shape", info["shape"] == piece["shape"]),
                                      ("byte count", end - start == piece["bytes"])) if not same]
    if differ:
        raise CheckpointError(f"{path}: piece {show(piece['key'])} of tensor {show(name)} has another {' and '.join(differ)} "
                              f"in the file than in the index ({stored_dtype}{piece['shape']}, {piece['bytes']} bytes); "
                              f"the file does not belong to this index. {_FIX_SENTENCE}")
    return start, end


def _check_piece(path: str, name: str, dtype: str, piece: dict, header: dict, data_start: int) -> None:
    start, end = piece_range(path, name, dtype, piece, header)
    crc = crc32_of_range(path, data_start + start, data_start + end)
    if crc != piece["crc32"]:
        raise crc_error(path, name, piece, crc)


def crc_error(path: str, name: str, piece: dict, crc: int) -> CheckpointError:
    return CheckpointError(f"{path}: piece {show(piece['key'])} of tensor {show(name)} fails its crc32 check (index "
                           f"{piece['crc32']:08x}, file {crc:08x}): the file is corrupted. {_FIX_SENTENCE}")


class PieceReader:
    """Reads boxes of saved global tensors, touching only the bytes that overlap them."""

    def __init__(self, ckpt_dir: str, index: dict):
        self.ckpt_dir, self.listed = ckpt_dir, keys_by_file(index)
        self._files: dict[str, tuple[str, dict, object]] = {}

    def handle(self, file: str) -> tuple[str, dict, object]:
        """(path, checked header, open safetensors handle) of shard file ``file`` (opened once,
        memory-mapped)."""
        if file not in self._files:
            path, header, _ = shard_header(self.ckpt_dir, file, self.listed[file])
            self._files[file] = (path, header, safetensors_call(path, safe_open, path, framework="pt", device="cpu"))
        return self._files[file]

    def read_box(self, name: str, entry: dict, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region ``box`` (global offsets, shape) of saved tensor ``name``, shape ``box[1]``,
        written into ``out`` when given (e.g. a view of a larger buffer)."""
        if out is None:
            out = torch.zeros(box[1], dtype=dtype_from_name(entry["dtype"]))
        filled = 0
        for piece in entry["pieces"]:
            piece_box = (tuple(piece["offsets"]), tuple(piece["shape"]))
            overlap = intersect(box, piece_box)
            if overlap is None or volume(overlap[1]) == 0:
                continue
            path, header, handle = self.handle(piece["file"])
            piece_range(path, name, entry["dtype"], piece, header)  # also when the crc32 pass was skipped
            if len(piece_box[1]) == 0:
                data = safetensors_call(path, handle.get_tensor, piece["key"])
            else:
                sliced = safetensors_call(path, handle.get_slice, piece["key"])
                data = safetensors_call(path, sliced.__getitem__, relative_slices(overlap, piece_box[0]))
            out[relative_slices(overlap, box[0])] = data
            filled += volume(overlap[1])
        if filled != volume(box[1]):
            raise CheckpointError(f"the saved pieces of {show(name)} cover {filled} of the {volume(box[1])} elements this "
                                  f"rank needs (box {box}); the index is inconsistent. Re-save the checkpoint")
        return out

    def fill(self, lt: LocalTensor, entry: dict) -> None:
        """Overwrite ``lt.tensor`` with its saved values; padding past the global end becomes zero."""
        fill_local(lt, lambda box, out: self.read_box(lt.name, entry, box, out=out))

    def close(self) -> None:
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

