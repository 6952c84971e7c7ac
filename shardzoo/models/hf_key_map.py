"""Which file tensors of a Hugging Face directory hold each tensor of a transformers model.

Most tensors are stored under the model's own names. MoE models are not: transformers 5's
``save_pretrained`` writes the names and layout of the original checkpoints (Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``), and its loader renames and fuses them through the
model's conversion mapping (``WeightRenaming`` / ``WeightConverter``). :func:`file_sources`
reads the same mapping, from transformers itself, so shardzoo reads the same files: a renamed
tensor maps to its one file tensor, a fused experts tensor to a
:class:`~shardzoo.checkpoint.hf_stacked.StackedSource` of its per-expert file tensors (only
the converters that stack experts on dim 0, then optionally concatenate their parts, are
understood; another converter is refused by name when one of its tensors is needed).
"""

from __future__ import annotations

import re

from torch import nn

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.hf_stacked import StackedSource


def _stacking_dim(converter) -> int | None:
    """The per-expert concatenation dim of a stack-then-concatenate converter, else None."""
    ops = list(getattr(converter, "operations", None) or ())
    names = [type(op).__name__ for op in ops]
    if not names or names[0] != "MergeModulelist" or getattr(ops[0], "dim", None) != 0:
        return None
    if names == ["MergeModulelist"]:
        return 0
    if names == ["MergeModulelist", "Concatenate"] and getattr(ops[1], "dim", 0) >= 1:
        return ops[1].dim - 1  # the stacked tensor's dim d is a per-expert tensor's d - 1
    return None


def _expert_index(renamed_key: str, pattern: str) -> int | None:
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, renamed_key)
    return int(found.group(1)) if found and found.groups() else None


def file_sources(model: nn.Module, names: list[str], file_keys) -> dict[str, str | StackedSource]:
    """For each of ``names`` (the model's tensor names) that ``file_keys`` lack, where the files
    hold it: a file key, or a StackedSource of per-expert keys. Names absent from the result
    are read under their own name (or reported missing by the caller)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_renamings, rename_source_key

    wanted = set(names)
    file_keys = list(file_keys)
    if wanted <= set(file_keys):
        return {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    known = dict.fromkeys(names, True)  # rename_source_key asks it which prefix the model uses
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, str | StackedSource] = {}
    parts: dict[str, dict[int, dict[int, str]]] = {}
    dims: dict[str, tuple[int | None, object]] = {}
    for key in file_keys:
        if key in wanted:
            continue
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if target not in wanted or target in file_keys:
            continue
        if pattern is None:
            out[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        expert = _expert_index(apply_renamings(key, renamings), pattern)
        dims[target] = (_stacking_dim(converter) if expert is not None else None, converter)
        parts.setdefault(target, {}).setdefault(-1 if expert is None else expert, {})[
            converter.source_patterns.index(pattern)] = key
    for target, by_expert in parts.items():
        dim, converter = dims[target]
        if dim is None:
            raise CheckpointError(f"the files store {target} through the transformers conversion "
                                  f"{type(converter).__name__}({converter.source_patterns} -> {converter.target_patterns}, "
                                  f"{getattr(converter, 'operations', None)}), which shardzoo does not read; only "
                                  f"per-expert tensors stacked on dim 0 (then concatenated) are understood. Load the "
                                  f"model with transformers and save its state with shardzoo.checkpoint.save")
        n_parts = len(converter.source_patterns)
        keys = []
        for e in range(max(by_expert) + 1):
            got = by_expert.get(e, {})
            if len(got) != n_parts:
                lost = [p for p in converter.source_patterns if converter.source_patterns.index(p) not in got]
                raise CheckpointError(f"the files hold some experts of {target} but not expert {e}'s {lost}; every "
                                      f"expert's {converter.source_patterns} must be present. Download the files again")
            keys.append(tuple(got[p] for p in range(n_parts)))
        out[target] = StackedSource(tuple(keys), dim)
    return out
