"""Hugging Face weights straight into a sharded (and pipelined) model.

    mesh = ParallelMesh(tp=4, tp_mode="2d")
    model = BERT.from_pretrained("all-MiniLM-L6-v2/", mesh=mesh)     # every rank

Each rank reads only the slices its own parameters hold: for every local tensor the box it
covers in the full tensor (from its ShardSpec) is mapped to the checkpoint tensor it comes from
(``FamilySpec.canonical`` names, the family's ``shardzoo_to_hf``) and read with safetensors
``get_slice`` from the memory-mapped file. GPT-2's Conv1D weights are read transposed and its
fused ``c_attn`` through a row map into the per-head fused ``attn.qkv`` (``hf_read_plan``).
Vocabulary padding rows are zero. Before anything is read the ranks agree on the names: model
tensors the checkpoint lacks (missing), checkpoint tensors no rank's model takes (unexpected)
and shape mismatches are reported by name.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.hf_files import HFWeights
from shardzoo.checkpoint.jsontypes import load_json_file, obj
from shardzoo.checkpoint.paths import resolve_in
from shardzoo.checkpoint.sync import Ranks, describe
from shardzoo.checkpoint.tensors import LocalTensor, fill_local, model_tensors
from shardzoo.layers.replicas import find_mesh
from shardzoo.models.spec import FamilySpec, all_specs, family_names, spec_of

class PretrainedLoadResult(NamedTuple):
    """Names not loaded."""

    missing_keys: list[str]  # model tensors the checkpoint lacks (left as initialised)
    # (with strict=True only the family's optional ones, e.g. BERT's pooler from BertForMaskedLM)
    unexpected_keys: list[str]  # checkpoint tensors that no rank's model takes


class _Source(NamedTuple):
    key: str  # checkpoint key in the file
    transposed: bool
    row: object  # callable row map or None


def _meta(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _produced(fam: FamilySpec, weights: HFWeights, config) -> dict[str, list[str]]:
    """Checkpoint key -> the shardzoo names ``hf_to_shardzoo`` makes of it (empty: dropped)."""
    return {key: [ours for ours, _ in fam.hf_to_shardzoo(fam.canonical(key), _meta(weights.shape(key)), config)]
            for key in weights.entries}


def _plan(model, fam: FamilySpec, weights: HFWeights, local: list[LocalTensor], produced: dict[str, list[str]]):
    """For this rank: sources of its tensors, missing names (with the checkpoint key each
    would be read from), shape problems."""
    config = model.config
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
        [(hf_name, expected)] = fam.shardzoo_to_hf(name, _meta(lt.global_shape), config)
        canon = hf_name
        transposed, row = fam.read_plan(name, config)
        if canon not in by_canonical:  # stored under another name (e.g. BERT's decoder.bias), as it is
            canon = alternates.get(name)
            if canon is None:
                missing[lt.name] = hf_name
                continue
            expected, transposed, row = _meta(lt.global_shape), False, None
        key = by_canonical[canon]
        if lt.tensor.is_floating_point() and not weights.is_float(key):
            problems.append(f"{weights.path(key)}: {key!r} holds {weights.entries[key][2]} values but {lt.name!r} is "
                            f"floating point; the file does not hold these weights")
            continue
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
    """Fill ``model`` (of a registered family, whole or one pipeline stage, any layout) from
    the Hugging Face weights in ``hf_dir``, each rank reading only its own slices.

    Collective over the default process group when it is initialised (every rank calls it).
    ``strict`` raises :class:`~shardzoo.checkpoint.CheckpointError` naming every missing,
    unexpected or mis-shaped tensor; without it the mismatched names come back and those
    tensors keep their values. Shape mismatches always raise; the family's optional tensors
    (``FamilySpec.optional_prefixes``: BERT's pooler) only come back as missing.
    """
    fam = spec_of(model)
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


def config_json(hf_dir: str) -> tuple[str, dict]:
    """(path, parsed object) of ``hf_dir/config.json``, read by the strict JSON reader; a
    missing directory or file, or JSON that is not an object, is a CheckpointError."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{hf_dir}: no such directory; pass the Hugging Face model directory (config.json "
                              f"next to its safetensors weights), e.g. the one save_pretrained wrote")
    path = resolve_in(hf_dir, "config.json", source=f"Hugging Face model directory {hf_dir}")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} has no config.json; a Hugging Face model directory holds config.json next to "
                              f"its weights")
    return path, obj(load_json_file(path), path, optional=None)


def config_from_dir(fam: FamilySpec, hf_dir: str):
    """The family's config dataclass from ``hf_dir/config.json``, checking ``model_type`` and
    every field's type and range (errors name the file and the field)."""
    path, data = config_json(hf_dir)
    model_type = data.get("model_type")
    if model_type is not None and model_type != fam.model_type:
        match = [f.model.__name__ for f in all_specs() if f.model_type == model_type]
        hint = f"load it with {match[0]}.from_pretrained" if match else f"shardzoo loads only {family_names()}"
        named = f"model_type {model_type!r}" if match else "a model_type shardzoo does not know"
        raise CheckpointError(f"{path} has {named}, but {fam.model.__name__} loads {fam.model_type!r} checkpoints; "
                              f"{hint}")
    return fam.config.from_json(data, source=path)
