"""Moving saved pieces into an export file byte for byte, without decoding them.

A piece of a row-major tensor is a set of byte runs of the full tensor (one run when it is
whole or split along its first split dim only). :func:`copy_tensor` copies those runs from the
memory-mapped shard files to their place in an output file (``os.copy_file_range`` inside the
kernel where possible, gathered ``pwritev`` otherwise); :func:`assemble` decodes a whole
tensor when a mapping must transform it. :class:`Shards` opens each shard file once, checks
every piece's header entry against the index and its crc32 on a worker thread.
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.paths import show
from shardzoo.checkpoint.reading import crc_error, keys_by_file, piece_range, shard_header, shard_path
from shardzoo.checkpoint.safetensors_io import dtype_from_name, nbytes
from shardzoo.checkpoint.st_header import entries

_FIX = "Restore the file from the original save or re-save the checkpoint"


MAX_RUNS = 1 << 16  # byte runs per tensor above which assembling it in memory is cheaper


def byte_runs(offsets, shape, full_shape, item: int) -> list[tuple[int, int, int]] | None:
    """A box of a row-major full tensor as the byte runs it occupies there: (offset in the box's
    own bytes, offset in the full tensor's bytes, length), in order; None above MAX_RUNS."""
    k = len(shape) - 1
    while k >= 0 and shape[k] == full_shape[k]:
        k -= 1
    if k < 0:  # the whole tensor
        return [(0, 0, nbytes(shape, torch.uint8) * item)]
    inner = item  # bytes of one step along dim k (the dims after it are whole)
    for g in full_shape[k + 1:]:
        inner *= g
    full_strides, box_strides, f, b = [], [], inner, inner * shape[k]
    for j in range(k, -1, -1):
        full_strides.insert(0, f)
        f *= full_shape[j]
    for j in range(k - 1, -1, -1):
        box_strides.insert(0, b)
        b *= shape[j]
    outer = 1
    for s in shape[:k]:
        outer *= s
    if outer > MAX_RUNS:
        return None
    src = torch.zeros((), dtype=torch.int64)
    dst = torch.tensor(sum(o * st for o, st in zip(offsets, full_strides)), dtype=torch.int64)
    for j in range(k):  # every index of the dims before k, row-major
        step = torch.arange(shape[j], dtype=torch.int64)
        src = src.unsqueeze(-1) + step * box_strides[j]
        dst = dst.unsqueeze(-1) + step * full_strides[j]
    n = inner * shape[k]
    return [(a, b, n) for a, b in zip(src.reshape(-1).tolist(), dst.reshape(-1).tolist())]


class Shards:
    """The checkpoint's shard files, memory-mapped once; pieces located and checked against
    the index, crc32 verified on a worker thread."""

    def __init__(self, ckpt_dir: str, index: dict):
        self.ckpt_dir, self.listed = ckpt_dir, keys_by_file(index)
        self._open: dict[str, tuple[int, mmap.mmap, dict, int]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardzoo-crc32")
        self._checks: list[Future] = []

    def _file(self, file: str):
        if file not in self._open:
            path, header, data_start = shard_header(self.ckpt_dir, file, self.listed[file])
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open it ({e.strerror}). {_FIX}") from None
            try:  # copy-on-write: a writable buffer for torch.frombuffer, pages shared with the cache
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                if len(mm) != data_start + sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries(header).values()):
                    raise CheckpointError(f"{path} changed size after its header was checked; another program is "
                                          f"writing it. {_FIX}")
            except BaseException as e:
                os.close(fd)
                if isinstance(e, OSError):
                    raise CheckpointError(f"{path}: cannot map it into memory ({e.strerror}). {_FIX}") from None
                raise
            self._open[file] = (fd, mm, header, data_start)
        return self._open[file]

    def locate(self, name: str, dtype: str, piece: dict) -> tuple[int, mmap.mmap, int]:
        """(fd, mmap, absolute start) of ``piece``'s bytes, after checking its header entry
        against the index; queues its crc32 check."""
        fd, mm, header, data_start = self._file(piece["file"])
        path = shard_path(self.ckpt_dir, piece["file"])
        start, _ = piece_range(path, name, dtype, piece, header)
        begin = data_start + start
        self._checks.append(self._pool.submit(self._check, path, name, piece, mm, begin))
        return fd, mm, begin

    @staticmethod
    def _check(path: str, name: str, piece: dict, mm: mmap.mmap, begin: int) -> None:
        with memoryview(mm) as view:
            crc = zlib.crc32(view[begin:begin + piece["bytes"]])
        if crc != piece["crc32"]:
            raise crc_error(path, name, piece, crc)

    def wait_checks(self) -> None:
        """Raise the first failed crc32 check of the pieces located so far."""
        checks, self._checks = self._checks, []
        for f in checks:
            f.result()

    def close(self) -> None:
        for f in self._checks:
            f.cancel()
        self._pool.shutdown(wait=True)
        for fd, mm, _, _ in self._open.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views it (an exception's traceback); the GC closes it
                pass
            os.close(fd)
        self._open.clear()


_copy_file_range_works = hasattr(os, "copy_file_range")
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def _copy(src_fd: int, mm: mmap.mmap, src: int, dst_fd: int, dst: int, n: int) -> None:
    """Copy ``n`` bytes at ``src`` of a shard file to ``dst`` of an output file: in the kernel
    where the file system allows it, else written from the memory map (no buffer of ours)."""
    global _copy_file_range_works
    while n > 0 and _copy_file_range_works:
        try:
            done = os.copy_file_range(src_fd, dst_fd, n, src, dst)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                raise
            _copy_file_range_works = False  # e.g. across file systems on older kernels
            break
        if done == 0:
            raise CheckpointError(f"a shard file ended while copying byte {src} onwards; it was truncated during the export")
        src, dst, n = src + done, dst + done, n - done
    if n > 0:
        with memoryview(mm) as view:
            pwritev_all(dst_fd, [view[src:src + n]], dst)


def pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Write ``bufs`` back to back at ``offset`` (gathered by the kernel, IOV_MAX at a time)."""
    i = 0
    while i < len(bufs):
        done = os.pwritev(fd, bufs[i:i + _IOV_MAX], offset)
        offset += done
        while i < len(bufs) and done >= len(bufs[i]):  # drop what was written; a short write resumes mid-buffer
            done -= len(bufs[i])
            i += 1
        if done:
            bufs[i] = bufs[i][done:]


def copy_tensor(shards: Shards, name: str, entry: dict, starts: list[tuple[int, int]]) -> bool:
    """Copy saved tensor ``name`` byte for byte to each (output fd, position) in ``starts``, without
    decoding it: one ``copy_file_range`` per piece that is one run of the full tensor, else the
    pieces' runs gathered from the memory maps. False (nothing done) when the pieces are cut
    into too many runs."""
    item = torch.empty((), dtype=dtype_from_name(entry["dtype"])).element_size()
    cut = [byte_runs(p["offsets"], p["shape"], entry["shape"], item) for p in entry["pieces"]]
    if any(runs is None for runs in cut) or sum(len(runs) for runs in cut) > MAX_RUNS:
        return False
    located = [shards.locate(name, entry["dtype"], p) for p in entry["pieces"]]
    if all(len(runs) == 1 for runs in cut):
        for (fd, mm, begin), runs in zip(located, cut):
            for dst_fd, start in starts:
                _copy(fd, mm, begin, dst_fd, start + runs[0][1], runs[0][2])
        return True
    views = {id(mm): memoryview(mm) for _, mm, _ in located}
    order = sorted((dst, views[id(mm)][begin + src:begin + src + n]) for (_, mm, begin), runs in zip(located, cut)
                   for src, dst, n in runs if n)  # the pieces tile the tensor: runs in output order are adjacent
    for dst_fd, start in starts:
        if order:
            pwritev_all(dst_fd, [b for _, b in order], start + order[0][0])
    return True


def assemble(shards: Shards, name: str, entry: dict) -> torch.Tensor:
    """The whole global tensor, built from memory-mapped pieces."""
    dtype = dtype_from_name(entry["dtype"])
    full = torch.empty(entry["shape"], dtype=dtype)
    for piece in entry["pieces"]:
        _, mm, begin = shards.locate(name, entry["dtype"], piece)
        if piece["bytes"] == 0:
            continue
        data = torch.frombuffer(mm, dtype=dtype, count=piece["bytes"] // full.element_size(), offset=begin)
        full[tuple(slice(o, o + s) for o, s in zip(piece["offsets"], piece["shape"]))] = data.view(piece["shape"])
        del data
    return full


def check_covered(name: str, entry: dict) -> None:
    total = 1
    for s in entry["shape"]:
        total *= s
    got = sum(nbytes(p["shape"], torch.uint8) for p in entry["pieces"])
    if got != total:
        raise CheckpointError(f"the saved pieces of {show(name)} hold {got} of its {total} elements; the index is "
                              f"inconsistent. Re-save the checkpoint")
