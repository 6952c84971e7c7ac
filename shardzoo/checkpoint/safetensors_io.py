"""Streaming safetensors files: write tensors one by one (crc32 each), check raw byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and byte range (``data_offsets``, relative to the data section), then the data.
Writing it here lets a rank stream pieces straight from its parameters, without building the
whole file in memory first, and checksum each piece on the way. The files stay ordinary
safetensors files: ``safetensors.safe_open`` reads them, and Hugging Face loads the exports.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib

import torch

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.st_header import read_header  # noqa: F401  (the reader lives there; imported from here too)

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CHUNK = 16 << 20  # bytes read at a time when checksumming a byte range

if sys.byteorder != "little":  # safetensors data is little-endian; we write memory as it is
    raise ImportError("shardzoo.checkpoint writes raw tensor memory and needs a little-endian machine")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling used in index.json)."""
    return str(dtype).removeprefix("torch.")


DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in ST_DTYPES}  # the dtypes index.json may name


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``, for the dtypes safetensors stores."""
    dtype = DTYPE_NAMES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointError(f"unknown dtype in the checkpoint index (known: {', '.join(DTYPE_NAMES)}); it was written "
                              f"by a newer shardzoo or is corrupted")
    return dtype


def write_all(fd: int, data, path: str, offset: int | None = None) -> None:
    """Write all of ``data`` to ``fd`` (at ``offset``, else at the current position); a failed
    write (full disk, I/O error) becomes a CheckpointError naming ``path``."""
    view = memoryview(data).cast("B")
    try:
        while view.nbytes:
            done = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
            view = view[done:]
            offset = None if offset is None else offset + done
    except OSError as e:
        raise write_error(path, e) from None


def write_error(path: str, e: OSError) -> CheckpointError:
    """The CheckpointError for a failed write or fsync of ``path``."""
    return CheckpointError(f"{path}: writing failed ({e.strerror or type(e).__name__}). Free space or fix the file "
                           f"system, then run it again")


def nbytes(shape, dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * torch.empty((), dtype=dtype).element_size()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` as stored on disk (copied to CPU / made contiguous only if needed)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def crc32_of(t: torch.Tensor) -> int:
    return zlib.crc32(tensor_bytes(t))


class SafetensorsWriter:
    """Writes one safetensors file whose entries are known up front, data streamed in order.

    Args:
        path: file to create (overwritten).
        entries: ``(key, dtype, shape)`` in the order their data will be written.
        metadata: string-to-string ``__metadata__`` of the header.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        if len({k for k, _, _ in entries}) != len(entries):
            raise ValueError(f"duplicate tensor names in {path}")
        header: dict = {"__metadata__": dict(metadata)}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for key, dtype, shape in entries:
            if dtype not in ST_DTYPES:
                raise CheckpointError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store; "
                                      f"cast it to one of {', '.join(dtype_name(d) for d in ST_DTYPES)}")
            size = nbytes(shape, dtype)
            header[key] = {"dtype": ST_DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + size]}
            self._expected.append((key, size))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
        self.path = path
        self.data_start = 8 + len(raw)
        self.total_bytes = self.data_start + offset
        self._next = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise write_error(path, e) from None
        try:
            write_all(self._fd, struct.pack("<Q", len(raw)) + raw, path)
        except BaseException:
            self.abort()
            raise

    def write(self, key: str, t: torch.Tensor) -> tuple[int, int]:
        """Append the data of entry ``key`` (the next one in order); returns (bytes, crc32)."""
        want_key, want_size = self._expected[self._next]
        data = tensor_bytes(t)
        if key != want_key or data.nbytes != want_size:
            raise RuntimeError(f"{self.path}: got {key!r} ({data.nbytes} bytes), expected {want_key!r} ({want_size} bytes)")
        write_all(self._fd, data, self.path)
        self._next += 1
        return data.nbytes, zlib.crc32(data)

    def close(self, fsync: bool = True) -> None:
        """Flush, fsync (so the bytes survive a crash once the index names them) and close."""
        try:
            if self._next != len(self._expected):
                raise RuntimeError(f"{self.path}: closed after {self._next} of {len(self._expected)} tensors")
            if fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise write_error(self.path, e) from None
        finally:
            self.abort()

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def crc32_of_range(path: str, start: int, end: int) -> int:
    """crc32 of bytes ``[start, end)`` of ``path``, read in chunks (bounded memory)."""
    crc = 0
    try:
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise CheckpointError(f"{path} ends at byte {end - left}, before byte {end}; it was truncated while "
                                          f"it was read")
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    return crc
