"""The header of a safetensors file, read as untrusted input.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON giving
each tensor's ``dtype``, ``shape`` and ``data_offsets`` (relative to the data section), then the
data. :func:`read_header` accepts a header only if it is what the safetensors library itself
accepts, and a little stricter: ``n`` at most 100 MB and inside the file, strict JSON (no
repeated keys), each entry exactly ``dtype`` / ``shape`` / ``data_offsets`` with a byte-sized
dtype, ``end - start`` equal to the elements times the item size, and the entries, in offset
order, tiling the data section from its first byte to the end of the file (no gap, no overlap,
nothing after). So nothing is allocated or read on the strength of a number the file claims
before that number has been checked against the file's real size.
"""

from __future__ import annotations

import math
import os
import struct

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.jsontypes import int_list, obj, parse_json, string
from shardzoo.checkpoint.paths import show

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
# bytes per element of the safetensors dtypes whose elements are whole bytes
ST_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                 "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_NOT_ST = "it is not a safetensors file, or it was truncated or overwritten"


def _read_exactly(fd: int, n: int, offset: int, path: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            raise CheckpointError(f"{path} became shorter while it was read; another program is writing it")
        out += chunk
    return bytes(out)


def _entry(path: str, key: str, info) -> tuple[int, int]:
    """(start, end) of one validated tensor entry."""
    where = f"{path}: header entry {show(key)}"
    obj(info, where, required=("dtype", "shape", "data_offsets"))
    dtype = string(info["dtype"], f"{where}, dtype")
    if dtype not in ST_ITEM_BYTES:
        raise CheckpointError(f"{where}: the dtype is not one of the byte-sized safetensors dtypes "
                              f"({', '.join(ST_ITEM_BYTES)}); {_NOT_ST}")
    shape = int_list(info["shape"], f"{where}, shape")
    offsets = int_list(info["data_offsets"], f"{where}, data_offsets", max_len=2)
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: data_offsets must be [start, end] with start <= end; {_NOT_ST}")
    if math.prod(shape) * ST_ITEM_BYTES[dtype] != offsets[1] - offsets[0]:
        raise CheckpointError(f"{where}: its shape and dtype need {math.prod(shape) * ST_ITEM_BYTES[dtype]} bytes but "
                              f"data_offsets span {offsets[1] - offsets[0]}; {_NOT_ST}")
    return offsets[0], offsets[1]


def check_header(path: str, header, data_bytes: int) -> dict:
    """``header`` (parsed JSON) checked as the header of a file with ``data_bytes`` of data."""
    obj(header, f"{path}: the safetensors header", optional=None)
    ranges = []
    for key, info in header.items():
        if key == "__metadata__":
            for name, value in obj(info, f"{path}: header __metadata__", optional=None).items():
                string(value, f"{path}: header __metadata__ {show(name)}")
            continue
        ranges.append((*_entry(path, key, info), key))
    at = 0
    for start, end, key in sorted(ranges):
        if start != at:
            what = "overlaps the tensor before it" if start < at else "leaves a gap before it"
            raise CheckpointError(f"{path}: header entry {show(key)} {what} in the data section (safetensors stores "
                                  f"tensors back to back); {_NOT_ST}")
        at = end
    if at != data_bytes:
        raise CheckpointError(f"{path}: the header's tensors cover {at} bytes but the file holds {data_bytes} bytes of "
                              f"data; {_NOT_ST}")
    return header


def read_header(path: str) -> tuple[dict, int]:
    """The checked JSON header of safetensors file ``path`` and the offset of its data section.

    Raises:
        CheckpointError naming the file and the rule it breaks (never quoting its bytes).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open it ({e.strerror or type(e).__name__})") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(f"{path} is {size} bytes, too short to be a safetensors file (at least 8)")
        (n,) = struct.unpack("<Q", _read_exactly(fd, 8, 0, path))
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: its header length field is above the safetensors limit of "
                                  f"{MAX_HEADER_BYTES} bytes; {_NOT_ST}")
        if 8 + n > size:
            raise CheckpointError(f"{path}: its header length field points past the end of the {size}-byte file; {_NOT_ST}")
        raw = _read_exactly(fd, n, 8, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    finally:
        os.close(fd)
    header = parse_json(raw, f"{path}: the safetensors header")
    return check_header(path, header, size - 8 - n), 8 + n


def entries(header: dict) -> dict[str, dict]:
    """The tensor entries of a checked header (``__metadata__`` left out)."""
    return {k: v for k, v in header.items() if k != "__metadata__"}
