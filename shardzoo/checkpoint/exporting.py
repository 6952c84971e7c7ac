"""``export_plain``: a sharded checkpoint -> plain safetensors weights in the Hugging Face layout.

Names: when the index's ``config_class`` is one of shardzoo's model families (GPT-2, BERT, ViT,
OPT), every tensor goes through that family's ``shardzoo_to_hf`` and ``config.json`` is the
family's Hugging Face config, so ``transformers`` loads the output directly. ``names="shardzoo"``
(and any checkpoint of another model) keeps the saved names and config. A ``rename`` hook
replaces the family's mapping.

Streaming, tensor by tensor, with the output headers planned up front (the mapping is first run
on meta tensors). Each output tensor is written at its known position in its file:

* a tensor the mapping passes through unchanged (same tensor object) whose pieces are each one
  contiguous byte run of the full tensor (whole, or split along its first split dim only) is
  copied byte for byte from the shard files (``os.copy_file_range``: inside the kernel, never
  decoded; ``bytecopy.py``);
* anything else (a transpose, a fused-QKV split, pieces split along a later dim) is assembled
  into one full tensor from memory-mapped pieces, mapped, and written from memory.

Every piece's crc32 is checked on a worker thread over the memory-mapped shard bytes while the
main thread copies; another thread starts the writeback of each 64 MiB written, so the closing
fsync waits for little. An output file is written as ``<name>.partial``, and is fsynced and renamed
into place only once all of its bytes are written and every piece read so far passed its
check; on any error the partial file is removed. Memory: about one global tensor (plus what
the mapping makes of it) on the decoding path, nothing on the copying path.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardzoo.checkpoint.bytecopy import Shards, assemble, check_covered, copy_tensor, pwritev_all
from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import read_index
from shardzoo.checkpoint.reading import entries_of, verify
from shardzoo.checkpoint.safetensors_io import ST_DTYPES, dtype_from_name, dtype_name, nbytes, tensor_bytes

Rename = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default shard size ("5GB")
NAMES = ("hf", "shardzoo")
_FLUSH_BYTES = 64 << 20  # output written between writeback starts


@dataclass
class _Out:
    """One output tensor: its name, dtype, shape, and whether the mapping passed the source
    tensor through unchanged (then its bytes are the source's bytes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    same: bool
    file_no: int = -1
    start: int = 0  # absolute byte offset in its output file


@dataclass
class _OutFile:
    path: str  # final path; data goes to path + ".partial" first
    outs: list[_Out]
    header: bytes
    size: int
    fd: int = -1
    left: int = 0  # tensors still to write
    flushed: int = 0  # bytes before this have been handed to writeback
    flushing: list[Future] = field(default_factory=list)  # those writeback starts

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
        finally:
            self.flushing = []
            os.close(self.fd)
            self.fd = -1


def _mapping(index: dict, names: str, rename: Rename | None) -> tuple[Rename | None, dict | None]:
    """The hook to apply to each saved tensor and the contents of config.json."""
    if names not in NAMES:
        raise ValueError(f"names={names!r}; choose 'hf' (Hugging Face names for shardzoo's model families) or 'shardzoo'")
    if names == "shardzoo" and rename is not None:
        raise ValueError("names='shardzoo' exports the saved names unchanged; drop rename= or use names='hf'")
    config = index.get("config")
    if names == "shardzoo" or config is None:
        return rename, config
    from shardzoo.models.families import family_of_config_class

    family = family_of_config_class(index.get("config_class"))
    if family is None:  # not a shardzoo model: the saved names are the only names there are
        return rename, config
    typed = family.config.from_json(config)
    return rename or functools.partial(family.code.shardzoo_to_hf, config=typed), family.hf_config(typed)


def _plan(index: dict, rename: Rename | None) -> list[tuple[str, list[_Out]]]:
    """Per source tensor, the outputs it maps to: ``rename`` run on meta tensors, so the output
    headers are known before any data is read."""
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
            if t.dtype not in ST_DTYPES:
                raise CheckpointError(f"tensor {out_name!r} has dtype {t.dtype}, which safetensors cannot store; "
                                      f"cast it to one of {', '.join(dtype_name(d) for d in ST_DTYPES)}")
            seen[out_name] = name
            row.append(_Out(out_name, t.dtype, tuple(t.shape), same=t is meta))
        plan.append((name, row))
    return plan


def _layout_files(plan, max_shard_bytes: int, out_dir: str) -> list[_OutFile]:
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
        files.append(_OutFile(os.path.join(out_dir, name), outs, raw, len(raw) + offset, left=len(outs)))
    return files


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


def _write_json(path: str, data: dict) -> None:
    with open(path + ".partial", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".partial", path)


def export_plain(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, names: str = "hf",
                 rename: Rename | None = None, progress: bool = True) -> list[str]:
    """Write the model tensors of checkpoint ``ckpt_dir`` as plain safetensors into ``out_dir``.

    One process; memory about one global tensor (plus what the mapping makes of it).

    Args:
        ckpt_dir: a checkpoint written by :func:`shardzoo.checkpoint.save`.
        out_dir: output directory (created); existing files of the same names are replaced.
        max_shard_bytes: largest output file before splitting into ``model-0000i-of-0000N``.
        names: ``"hf"``: a checkpoint of a shardzoo model family (GPT-2, BERT, ViT, OPT; known
            from the index's ``config_class``) gets that family's Hugging Face names and layouts
            and a Hugging Face ``config.json``, which ``transformers`` loads with
            ``from_pretrained``; other checkpoints keep their names. ``"shardzoo"``: the saved
            names and config, unchanged.
        rename: ``rename(name, tensor) -> [(new_name, new_tensor), ...]``, a mapping of your own
            used instead of the family's (may split, transpose, drop: return []). It is first
            called on meta tensors to plan the files, so it must use torch ops only; an output
            that is the input tensor object itself is copied without decoding.
        progress: show a progress bar (tqdm if installed, else a counter on stderr).

    Returns:
        The paths written.
    """
    index = read_index(ckpt_dir)
    hook, config_json = _mapping(index, names, rename)
    entries = entries_of(index, ("model",))
    verify(ckpt_dir, index, entries, 0, 1, checksums=False)  # sizes now; headers and crc32 as pieces are read
    plan = _plan(index, hook)
    os.makedirs(out_dir, exist_ok=True)
    files = _layout_files(plan, max_shard_bytes, out_dir)
    shards = Shards(ckpt_dir)
    flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardzoo-writeback")
    bar = _Progress(len(plan), progress)
    current: list[_OutFile] = []

    def output(out: _Out) -> _OutFile:
        return opened(files[out.file_no])

    def opened(f: _OutFile) -> _OutFile:
        if f.fd < 0:
            f.fd = os.open(f.path + ".partial", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            current.append(f)
            pwritev_all(f.fd, [memoryview(f.header)], 0)
        return f

    def finish(f: _OutFile) -> None:
        shards.wait_checks()  # every piece copied into it so far passed its crc32 check
        if os.fstat(f.fd).st_size != f.size:
            raise CheckpointError(f"{f.path}: wrote {os.fstat(f.fd).st_size} of {f.size} bytes")
        f.close(sync=True)  # the bytes are on disk before the name says the file is complete
        os.replace(f.path + ".partial", f.path)
        current.remove(f)

    try:
        for name, row in plan:
            entry = index["tensors"][name]
            check_covered(name, entry)
            if not (all(out.same for out in row) and copy_tensor(shards, name, entry, [(output(o).fd, o.start) for o in row])):
                full = assemble(shards, name, entry)
                outs = hook(name, full) if hook is not None else [(name, full)]
                if [(n, t.dtype, tuple(t.shape)) for n, t in outs] != [(o.name, o.dtype, o.shape) for o in row]:
                    raise CheckpointError(f"rename({name!r}) returned {[(n, tuple(t.shape)) for n, t in outs]} on real data "
                                          f"but {[(o.name, o.shape) for o in row]} on meta tensors; it must not depend on values")
                for out, (_, t) in zip(row, outs):
                    pwritev_all(output(out).fd, [tensor_bytes(t)], out.start)
                del full, outs
            for out in row:
                f = output(out)
                f.left -= 1
                if f.left == 0:
                    finish(f)
                else:
                    f.written_up_to(out.start + nbytes(out.shape, out.dtype), flusher)
            bar.step(name)
        if not files[0].outs:  # a model without tensors: still a valid (empty) file
            finish(opened(files[0]))
    except BaseException:
        for f in current:
            f.close(sync=False)
            if os.path.exists(f.path + ".partial"):
                os.unlink(f.path + ".partial")
        raise
    finally:
        bar.close()
        shards.close()
        flusher.shutdown(wait=True)
    written = [f.path for f in files]
    if len(files) > 1:
        path = os.path.join(out_dir, "model.safetensors.index.json")
        weight_map = {out.name: os.path.basename(f.path) for f in files for out in f.outs}
        total = sum(f.size - len(f.header) for f in files)
        _write_json(path, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(path)
    if config_json is not None:
        path = os.path.join(out_dir, "config.json")
        _write_json(path, config_json)
        written.append(path)
    return written
