"""The files ``export_plain`` writes, and the order that keeps a half-done export recognisable.

Output names are this library's own (``model.safetensors``, ``model-0000i-of-0000N.safetensors``,
``model.safetensors.index.json``, ``config.json``); nothing read from the checkpoint becomes a
file name. Every file is first written as ``<name>.partial`` (created anew with
``O_EXCL | O_NOFOLLOW`` after removing whatever was there, so a planted symlink is never
written through) and fsynced. Only when all of them are on disk are they published
(:func:`publish`): the previous export's ``config.json`` and index, and its weight files that
the new export does not replace, are removed first (``unlink`` removes a link, never its
target), then the files are renamed into place (``rename`` replaces a link, never follows it):
weights, then the index, then ``config.json``. So an export that fails leaves the previous
output as it was, and one killed while publishing leaves a directory without ``config.json``
(and, with several weight files, without the index): never one that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from shardzoo.checkpoint.atomic import fsync_dir
from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.hf_files import INDEX_FILE  # noqa: F401  (the export writes the layout HF loading reads)
from shardzoo.checkpoint.safetensors_io import ST_DTYPES, nbytes, write_all, write_error

CONFIG_FILE = "config.json"
_OWNED = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json|config\.json")
_FLUSH_BYTES = 64 << 20  # output written between writeback starts


@dataclass
class Out:
    """One output tensor: its name, dtype, shape, and whether the mapping passed the source
    tensor through unchanged (then its bytes are the source's bytes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    same: bool
    file_no: int = -1
    start: int = 0  # absolute byte offset in its output file


@dataclass
class OutFile:
    path: str  # final path; data goes to path + ".partial" first
    outs: list[Out]
    header: bytes
    size: int
    fd: int = -1
    left: int = 0  # tensors still to write
    flushed: int = 0  # bytes before this have been handed to writeback
    flushing: list[Future] = field(default_factory=list)  # those writeback starts

    def open(self) -> None:
        """Create ``<path>.partial`` anew (never through a link) and write the header."""
        self.fd = create_new(self.path + ".partial")
        write_all(self.fd, self.header, self.path, offset=0)

    def written_up_to(self, end: int, pool: ThreadPoolExecutor) -> None:
        """Every byte before ``end`` is written: start writing the last ``_FLUSH_BYTES`` or more
        to disk now, on ``pool``'s thread, so the closing fsync overlaps with the copying and
        waits for less. On Linux, POSIX_FADV_DONTNEED starts writeback of dirty pages (it
        drops only clean ones, and these are not)."""
        if end - self.flushed >= _FLUSH_BYTES and hasattr(os, "posix_fadvise"):
            self.flushing.append(pool.submit(os.posix_fadvise, self.fd, self.flushed, end - self.flushed,
                                             os.POSIX_FADV_DONTNEED))
            self.flushed = end

    def close(self, sync: bool) -> None:
        """Wait for the writeback starts, fsync when ``sync`` (errors of either are raised), close."""
        if self.fd < 0:
            return
        try:
            for f in self.flushing:
                f.result()
            if sync:
                os.fsync(self.fd)
        except OSError as e:
            raise write_error(self.path, e) from None
        finally:
            self.flushing = []
            os.close(self.fd)
            self.fd = -1

    def finish(self) -> None:
        """All bytes written: check the size, fsync and close (published later, with the rest)."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            raise CheckpointError(f"{self.path}: wrote {size} of {self.size} bytes")
        self.close(sync=True)  # the bytes are on disk before the name says the file is complete

    def discard(self) -> None:
        """Close and remove the unfinished file (after an error, which is the one raised)."""
        try:
            self.close(sync=False)
        except CheckpointError:
            pass
        remove_partial(self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)  # a symlink itself, never its target
    except FileNotFoundError:
        pass
    except OSError as e:
        raise write_error(path, e) from None


def create_new(path: str) -> int:
    """A new file at ``path`` for writing, never through a symlink (what is there is removed first)."""
    _unlink(path)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise write_error(path, e) from None


def remove_partial(path: str) -> None:
    _unlink(path + ".partial")


def publish(out_dir: str, paths: list[str]) -> None:
    """Rename the finished ``<path>.partial`` of every path in ``paths`` (weights, then index and
    config.json) into place, after removing the previous export's files that would otherwise
    mix with them."""
    keep = {os.path.basename(p) for p in paths if p.endswith(".safetensors")}  # replaced by the renames
    try:
        stale = [n for n in os.listdir(out_dir) if _OWNED.fullmatch(n) and n not in keep]
        for name in sorted(stale, key=lambda n: n != CONFIG_FILE):  # config.json first: no longer complete
            os.unlink(os.path.join(out_dir, name))
        for p in paths:
            os.replace(p + ".partial", p)
    except OSError as e:
        raise write_error(e.filename or out_dir, e) from None
    fsync_dir(out_dir)


def make_dir(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out_dir}: cannot create the output directory ({e.strerror or type(e).__name__}); "
                              f"choose another directory or fix its permissions") from None


def write_json(path: str, data: dict) -> None:
    """``data`` as ``<path>.partial``, fsynced (published by :func:`publish`)."""
    fd = create_new(path + ".partial")
    try:
        write_all(fd, json.dumps(data, indent=2).encode(), path)
        os.fsync(fd)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        os.close(fd)


def layout_files(plan, max_shard_bytes: int, out_dir: str) -> list[OutFile]:
    """Output tensors grouped into files of at most ``max_shard_bytes`` (a bigger tensor gets its
    own), each with its header and every tensor's position."""
    groups, current, size = [], [], 0
    for _, row in plan:
        for out in row:
            n = nbytes(out.shape, out.dtype)
            if current and size + n > max_shard_bytes:
                groups.append(current)
                current, size = [], 0
            current.append(out)
            size += n
    groups.append(current)
    many = len(groups) > 1
    files = []
    for i, outs in enumerate(groups):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for out in outs:
            n = nbytes(out.shape, out.dtype)
            header[out.name] = {"dtype": ST_DTYPES[out.dtype], "shape": list(out.shape), "data_offsets": [offset, offset + n]}
            out.file_no, out.start = i, offset
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
        raw = struct.pack("<Q", len(raw)) + raw
        for out in outs:
            out.start += len(raw)
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if many else "model.safetensors"
        files.append(OutFile(os.path.join(out_dir, name), outs, raw, len(raw) + offset, left=len(outs)))
    return files


def write_hf_index(files: list[OutFile], path: str) -> None:
    """``model.safetensors.index.json`` (Hugging Face's layout) for the weight files ``files``,
    as ``<path>.partial``."""
    weight_map = {out.name: os.path.basename(f.path) for f in files for out in f.outs}
    total = sum(f.size - len(f.header) for f in files)
    write_json(path, {"metadata": {"total_size": total}, "weight_map": weight_map})
