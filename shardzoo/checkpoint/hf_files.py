"""The weight files of a Hugging Face model directory, read as untrusted input.

``model.safetensors``, or ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map":
{tensor: file}}``) and the files it names. Every file name goes through :func:`resolve_in`
(paths.py: no path or symlink leaves the directory), the index is checked field by field, every
header is checked to safetensors' rules (st_header.py), and the index must list exactly the
tensors each file holds. Data is then read by slices from memory-mapped files
(``safe_open(...).get_slice``), or, for whole rows in the file's dtype, straight into the
destination tensor (``read_rows_into``).
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors import safe_open

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.jsontypes import load_json_file, obj, string
from shardzoo.checkpoint.paths import resolve_in, show
from shardzoo.checkpoint.reading import safetensors_call
from shardzoo.checkpoint.safetensors_io import ST_DTYPES
from shardzoo.checkpoint.st_header import entries, read_header
from shardzoo.checkpoint.tensors import Box

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_map(index_path: str, hf_dir: str) -> dict[str, str]:
    """The checked ``weight_map`` of a Hugging Face ``model.safetensors.index.json``."""
    data = obj(load_json_file(index_path), index_path, required=("weight_map",), optional=("metadata",))
    if data.get("metadata") is not None:
        obj(data["metadata"], f"{index_path}, metadata", optional=None)
    weight_map = obj(data["weight_map"], f"{index_path}, weight_map", optional=None)
    for key, file in weight_map.items():
        where = f"{index_path}, weight_map[{show(key)}]"
        resolve_in(hf_dir, string(file, where), source=where)
    return weight_map


class HFWeights:
    """The tensors of a Hugging Face model directory (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``), by checkpoint key: shapes and dtypes from the checked
    headers, data read by slices from memory-mapped files.

    Attributes:
        entries: checkpoint key -> (file name, shape, safetensors dtype such as "F32").
        sources: model tensor name -> where the files hold it when not under that name (a
            renamed key, or a hf_stacked.StackedSource of per-expert tensors); set by the
            loader, which knows the model.
    """

    def __init__(self, hf_dir: str):
        self.hf_dir = os.fspath(hf_dir)
        source = f"Hugging Face model directory {self.hf_dir}"
        single, index = resolve_in(self.hf_dir, SINGLE_FILE, source=source), resolve_in(self.hf_dir, INDEX_FILE, source=source)
        weight_map = None
        if os.path.isfile(single):
            files = [SINGLE_FILE]
        elif os.path.isfile(index):
            weight_map = _weight_map(index, self.hf_dir)
            files = sorted(set(weight_map.values()))
        else:
            present = sorted(os.listdir(self.hf_dir)) if os.path.isdir(self.hf_dir) else None
            what = (f"holds {present[:10]}" + (f" and {len(present) - 10} more" if len(present) > 10 else "")
                    if present is not None else "does not exist")
            raise CheckpointError(
                f"{self.hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (it {what}). Point to a Hugging Face model "
                f"directory saved as safetensors; a pytorch_model.bin model converts with transformers: "
                f"AutoModel.from_pretrained(d).save_pretrained(out)")
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}
        self.sources: dict[str, object] = {}
        self._data_at: dict[str, int] = {}  # key -> where its bytes start in its file
        for file in files:
            path = resolve_in(self.hf_dir, file, source=f"{index}, weight_map" if weight_map else source)
            if not os.path.isfile(path):
                raise CheckpointError(f"{INDEX_FILE} in {self.hf_dir} names {path}, which is missing; download or copy "
                                      f"every shard the index lists")
            header, data_start = read_header(path)
            for key, info in entries(header).items():
                if weight_map is not None and weight_map.get(key) != file:
                    raise CheckpointError(f"{path} holds tensor {show(key)}, which {index} does not map to this file; "
                                          f"the index does not belong to these files. Download them again")
                if key in self.entries:
                    raise CheckpointError(f"{path} and {self.entries[key][0]} both hold tensor {show(key)}; the weight "
                                          f"files do not belong together. Download them again")
                self.entries[key] = (file, tuple(info["shape"]), info["dtype"])
                self._data_at[key] = data_start + info["data_offsets"][0]
        if weight_map is not None and len(weight_map) != len(self.entries):
            lost = next(k for k in weight_map if k not in self.entries)
            raise CheckpointError(f"{index} maps tensor {show(lost)} to {show(weight_map[lost])}, which does not hold it; "
                                  f"the index does not belong to these files. Download them again")

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def is_float(self, key: str) -> bool:
        """Whether checkpoint tensor ``key`` holds floating-point values."""
        return self.entries[key][2].startswith(("F", "BF"))

    def path(self, key: str) -> str:
        return os.path.join(self.hf_dir, self.entries[key][0])

    def _open(self, key: str):
        # A fresh memory map per tensor: pages a read touches (a transposed read touches every page
        # of its tensor) stay resident while the file is mapped, so keeping one map open for the
        # whole load would make every rank's memory peak the size of the file.
        path = self.path(key)
        return safetensors_call(path, safe_open, path, framework="pt", device="cpu")

    def read_rows_into(self, key: str, box: Box, out: torch.Tensor) -> bool:
        """Read box ``box`` of tensor ``key`` straight from the file into ``out`` when the box is
        whole rows (a contiguous byte range) and ``out`` a contiguous CPU tensor of the file's
        dtype; return False, reading nothing, otherwise. Plain reads leave no file pages mapped
        in this process and need no staging copy, so a rank's memory holds only ``out``."""
        file, shape, st_dtype = self.entries[key]
        offsets, box_shape = box
        if (sys.byteorder != "little" or not shape or out.device.type != "cpu" or not out.is_contiguous()
                or ST_DTYPES.get(out.dtype) != st_dtype or tuple(out.shape) != tuple(box_shape)
                or any(offsets[1:]) or tuple(box_shape[1:]) != tuple(shape[1:])):
            return False
        try:
            buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        except (RuntimeError, TypeError):  # torch built without numpy
            return False
        row_bytes = buffer.nbytes // box_shape[0] if box_shape[0] else 0
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(self._data_at[key] + offsets[0] * row_bytes)
                done = 0
                while done < buffer.nbytes:
                    n = f.readinto(buffer[done:])
                    if not n:
                        raise CheckpointError(f"{path} became shorter while it was read; another program is writing it")
                    done += n
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {key} ({e.strerror or type(e).__name__})") from None
        return True

    def read(self, key: str, box: Box, transposed: bool = False, row=None) -> torch.Tensor:
        """Region ``box`` (offsets, shape) of the tensor that checkpoint tensor ``key`` becomes
        after an optional 2-D transpose and a row map (row r of the result is row ``row(r)``)."""
        offsets, shape = box
        path = self.path(key)
        with self._open(key) as handle:
            data = safetensors_call(path, handle.get_slice, key)
            if not shape:
                return safetensors_call(path, data.__getitem__, ...)
            rest = tuple(slice(o, o + s) for o, s in zip(offsets[1:], shape[1:]))
            rows = [row(r) for r in range(offsets[0], offsets[0] + shape[0])] if row else None
            runs = _runs(rows) if rows else [(offsets[0], shape[0])]
            index = [(rest[0], slice(start, start + n)) if transposed else (slice(start, start + n),) + rest
                     for start, n in runs]
            parts = [safetensors_call(path, data.__getitem__, i) for i in index]
            parts = [p.t() for p in parts] if transposed else parts
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 3), (9, 2)]: maximal runs of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs
