"""Hugging Face weights straight into a sharded (and pipelined) model.

    mesh = ParallelMesh(tp=4, tp_mode="2d")
    model = BERT.from_pretrained("all-MiniLM-L6-v2/", mesh=mesh)     # every rank

Each rank reads only the slices its own parameters hold: for every local tensor the box it
covers in the full tensor (from its ShardSpec) is mapped to the checkpoint tensor it comes from
(``Family.canonical`` names, the family's ``shardzoo_to_hf``) and read with safetensors
``get_slice`` from the memory-mapped file. GPT-2's Conv1D weights are read transposed and its
fused ``c_attn`` through a row map into the per-head fused ``attn.qkv`` (``hf_read_plan``).
Vocabulary padding rows are zero. Before anything is read the ranks agree on the names: model
tensors the checkpoint lacks (missing), checkpoint tensors no rank's model takes (unexpected)
and shape mismatches are reported by name.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import NamedTuple

import torch
from safetensors import safe_open

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.safetensors_io import read_header
from shardzoo.checkpoint.sync import Ranks, describe
from shardzoo.checkpoint.tensors import Box, LocalTensor, fill_local, find_mesh, model_tensors
from shardzoo.models.families import FAMILIES, Family, family_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ST_TO_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


class PretrainedLoadResult(NamedTuple):
    """Names not loaded."""

    missing_keys: list[str]  # model tensors the checkpoint lacks (left as initialised)
    # (with strict=True only the family's optional ones, e.g. BERT's pooler from BertForMaskedLM)
    unexpected_keys: list[str]  # checkpoint tensors that no rank's model takes


class HFWeights:
    """The tensors of a Hugging Face model directory (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``), by checkpoint key: shapes from the headers, data read
    by slices from memory-mapped files."""

    def __init__(self, hf_dir: str):
        self.hf_dir = os.fspath(hf_dir)
        single, index = os.path.join(self.hf_dir, SINGLE_FILE), os.path.join(self.hf_dir, INDEX_FILE)
        if os.path.isfile(single):
            files = [SINGLE_FILE]
        elif os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            present = sorted(os.listdir(self.hf_dir)) if os.path.isdir(self.hf_dir) else None
            what = f"holds {present}" if present is not None else "does not exist"
            raise CheckpointError(
                f"{self.hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (it {what}). Point to a Hugging Face model "
                f"directory saved as safetensors; a pytorch_model.bin model converts with transformers: "
                f"AutoModel.from_pretrained(d).save_pretrained(out)")
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}  # key -> (file, shape, st dtype)
        for file in files:
            path = os.path.join(self.hf_dir, file)
            if not os.path.isfile(path):
                raise CheckpointError(f"{INDEX_FILE} in {self.hf_dir} names {file}, which is missing; download or copy "
                                      f"every shard the index lists")
            header, _ = read_header(path)
            for key, info in header.items():
                if key != "__metadata__":
                    self.entries[key] = (file, tuple(info["shape"]), info["dtype"])

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def _open(self, key: str):
        # A fresh memory map per tensor: pages a read touches (a transposed read touches every page
        # of its tensor) stay resident while the file is mapped, so keeping one map open for the
        # whole load would make every rank's memory peak the size of the file.
        return safe_open(os.path.join(self.hf_dir, self.entries[key][0]), framework="pt", device="cpu")

    def read(self, key: str, box: Box, transposed: bool = False, row=None) -> torch.Tensor:
        """Region ``box`` (offsets, shape) of the tensor that checkpoint tensor ``key`` becomes
        after an optional 2-D transpose and a row map (row r of the result is row ``row(r)``)."""
        offsets, shape = box
        with self._open(key) as handle:
            data = handle.get_slice(key)
            if not shape:
                return data[...]
            rest = tuple(slice(o, o + s) for o, s in zip(offsets[1:], shape[1:]))
            rows = [row(r) for r in range(offsets[0], offsets[0] + shape[0])] if row else None
            runs = _runs(rows) if rows else [(offsets[0], shape[0])]
            parts = [data[rest[0], start:start + n].t() if transposed else data[(slice(start, start + n),) + rest]
                     for start, n in runs]
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


class _Source(NamedTuple):
    key: str  # checkpoint key in the file
    transposed: bool
    row: object  # callable row map or None


def _meta(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _produced(fam: Family, weights: HFWeights, config) -> dict[str, list[str]]:
    """Checkpoint key -> the shardzoo names ``hf_to_shardzoo`` makes of it (empty: dropped)."""
    return {key: [ours for ours, _ in fam.code.hf_to_shardzoo(fam.canonical(key), _meta(weights.shape(key)), config)]
            for key in weights.entries}


def _plan(model, fam: Family, weights: HFWeights, local: list[LocalTensor], produced: dict[str, list[str]]):
    """For this rank: sources of its tensors, missing names (with the checkpoint key each
    would be read from), shape problems."""
    config, code = model.config, fam.code
    by_canonical = {fam.canonical(k): k for k in weights.entries}
    alternates: dict[str, str] = {}  # shardzoo name -> canonical key providing it under another name
    for key, names in produced.items():
        for ours in names:
            alternates.setdefault(ours, fam.canonical(key))
    sources, missing, problems = {}, {}, []
    for lt in local:
        name = lt.name
        if name not in alternates and name in model.tied_names:
            name = model.tied_names[name]  # an untied copy of a tied table reads the table
        [(hf_name, expected)] = code.shardzoo_to_hf(name, _meta(lt.global_shape), config)
        canon = hf_name
        transposed, row = code.hf_read_plan(name, config) if hasattr(code, "hf_read_plan") else (False, None)
        if canon not in by_canonical:  # stored under another name (e.g. BERT's decoder.bias), as it is
            canon = alternates.get(name)
            if canon is None:
                missing[lt.name] = hf_name
                continue
            expected, transposed, row = _meta(lt.global_shape), False, None
        key = by_canonical[canon]
        if tuple(weights.shape(key)) != tuple(expected.shape):
            problems.append(f"{key!r} is {list(weights.shape(key))} in the checkpoint but {lt.name!r} needs "
                            f"{list(expected.shape)}; the config.json does not describe these weights")
            continue
        sources[lt.name] = _Source(key, transposed, row)
    return sources, missing, problems


def _unexpected(produced: dict[str, list[str]], covered: set[str]) -> list[str]:
    """Checkpoint keys that feed a name no rank holds (dropped ones excluded)."""
    return [key for key, names in produced.items() if any(name not in covered for name in names)]


def load_pretrained(model, hf_dir: str, *, strict: bool = True) -> PretrainedLoadResult:
    """Fill ``model`` (a GPT2 / BERT / ViT / OPT, whole or one pipeline stage, any layout) from
    the Hugging Face weights in ``hf_dir``, each rank reading only its own slices.

    Collective over the default process group when it is initialised (every rank calls it).
    ``strict`` raises :class:`~shardzoo.checkpoint.CheckpointError` naming every missing,
    unexpected or mis-shaped tensor; without it the mismatched names come back and those
    tensors keep their values. Shape mismatches always raise; the family's optional tensors
    (``Family.optional_prefixes``: BERT's pooler) only come back as missing.
    """
    fam = family_of(model)
    mesh = find_mesh(model)
    ranks = Ranks(getattr(mesh, "timeout", None) or datetime.timedelta(minutes=10))
    what = f"loading Hugging Face weights from {hf_dir}"
    error, payload, local, sources, produced = None, None, [], {}, {}
    try:
        weights = HFWeights(hf_dir)
        local, aliases = model_tensors(model)
        produced = _produced(fam, weights, model.config)
        sources, missing, problems = _plan(model, fam, weights, local, produced)
        payload = (missing, problems, [lt.name for lt in local] + list(aliases))
    except Exception as e:
        error = describe(e)
    replies = ranks.agree(error, what, payload)
    problems = sorted({p for _, ps, _ in replies for p in ps})
    if problems:
        raise CheckpointError(f"{hf_dir} does not fit the model:\n" + "\n".join(problems))
    wanted = {name: key for ms, _, _ in replies for name, key in ms.items()}  # missing name -> checkpoint key
    missing = sorted(wanted)
    unexpected = _unexpected(produced, {n for _, _, names in replies for n in names})
    required = [m for m in missing if not m.startswith(fam.optional_prefixes)]
    if strict and (required or unexpected):
        # name the key the file lacks too where it differs from ours (GPT-2's c_attn -> attn.qkv)
        named = [m if wanted[m] == m else f"{m} (checkpoint key {wanted[m]})" for m in required]
        lines = [f"{label} ({len(names)}): {', '.join(names[:20])}" + (" ..." if len(names) > 20 else "")
                 for label, names in (("missing from the checkpoint", named),
                                      ("in the checkpoint but not in the model", unexpected)) if names]
        raise CheckpointError(f"{hf_dir} does not match {type(model).__name__}:\n" + "\n".join(lines) +
                              "\nCheck the family and config.json, or pass strict=False to load the matching tensors "
                              "and get the rest back")
    error = None
    try:
        for lt in local:
            src = sources.get(lt.name)
            if src is not None:
                fill_local(lt, lambda box, out, src=src: out.copy_(weights.read(src.key, box, src.transposed, src.row)))
    except Exception as e:
        error = describe(e)
    ranks.agree(error, what)
    return PretrainedLoadResult(missing, unexpected)


def config_from_dir(fam: Family, hf_dir: str):
    """The family's config dataclass from ``hf_dir/config.json``, checking ``model_type``."""
    path = os.path.join(os.fspath(hf_dir), "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} has no config.json; a Hugging Face model directory holds config.json next to "
                              f"its weights")
    with open(path) as f:
        data = json.load(f)
    model_type = data.get("model_type")
    if model_type is not None and model_type != fam.model_type:
        match = [f.model_class for f in FAMILIES.values() if f.model_type == model_type]
        hint = f"load it with {match[0]}.from_pretrained" if match else f"shardzoo loads only {sorted(FAMILIES)}"
        raise CheckpointError(f"{path} has model_type {model_type!r}, but {fam.model_class} loads {fam.model_type!r} "
                              f"checkpoints; {hint}")
    return fam.config.from_json(data)
