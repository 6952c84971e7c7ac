"""One spec per model family, and the registry of them.

Each model file defines its family's :class:`FamilySpec` next to its classes (``GPT2_SPEC`` at
the bottom of models/gpt2.py) and ``shardzoo.models`` registers them on import, so the CLI,
the demo, the planner and the tests list the families from :func:`all_specs`. This module sits
below the model files and imports none of them: code that needs a family's classes or names
gets them from a spec, found with :func:`spec_of` (a model or config, its class or any
subclass) or :func:`spec_named`.

Each family's parameter names follow one Hugging Face class (``architecture``) outside the
blocks; that class's checkpoint keys are the *canonical* names here. Checkpoints of the bare
base model (``GPT2Model``, ``BertModel``, ...) lack the ``base_prefix``; old BERT checkpoints
name LayerNorm parameters ``gamma`` / ``beta``. :meth:`FamilySpec.canonical` maps any of these
keys to the canonical name.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardzoo.checkpoint.adapters import ExportAdapter, register_export_adapter

NameMap = Callable[..., list[tuple[str, torch.Tensor]]]  # (name, full tensor, config=) -> [(name, tensor)]

_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


@dataclass(frozen=True)
class FamilySpec:
    """Everything shardzoo knows about one model family.

    Attributes:
        name: shardzoo's name ("gpt2", "bert", "vit", "opt").
        model: the model class (a :class:`~shardzoo.models.pipeline.StagedModel`).
        config: its config dataclass.
        model_type: the ``model_type`` of its Hugging Face config.json.
        architecture: the Hugging Face class whose checkpoint keys the model's names follow.
        base_prefix: the prefix of the base model's keys in that class ("transformer.").
        head_prefixes: keys outside the base model (heads), never prefixed.
        hf_to_shardzoo, shardzoo_to_hf: one full-size tensor's Hugging Face name -> shardzoo's
            and back, ``(name, tensor, config) -> [(name, tensor), ...]``.
        tiny_config: ``(layers=2, vocab=101, ffn=64, dropout=0.0, hidden=32, heads=4) -> dict``,
            the constructor arguments of a tiny model of the family, for tests.
        hf_read_plan: ``(name, config) -> (transposed, row map)`` where a shardzoo tensor is not
            a plain box of its checkpoint tensor (GPT-2's Conv1D and fused ``c_attn``); None:
            every tensor is.
        optional_prefixes: model tensors that checkpoints of ``architecture`` may lack (BERT's
            pooler: ``BertForMaskedLM`` has none); left as initialised and reported in
            ``missing_keys``, but not an error with ``strict``.
        plan: how ``shardzoo.parallelize`` shards the family (None: not given).
        presets: ``shardzoo plan``'s presets of the family, ``{name: (config fields, source)}``:
            the config.json values of published checkpoints.
    """

    name: str
    model: type
    config: type
    model_type: str
    architecture: str
    base_prefix: str
    head_prefixes: tuple[str, ...]
    hf_to_shardzoo: NameMap
    shardzoo_to_hf: NameMap
    tiny_config: Callable[..., dict]
    hf_read_plan: Callable[[str, Any], tuple[bool, Any]] | None = None
    optional_prefixes: tuple[str, ...] = ()
    plan: Any = None
    presets: dict[str, tuple[dict, str]] = field(default_factory=dict)

    @property
    def config_path(self) -> str:
        """The config class's import path, as checkpoint indexes record it
        ("shardzoo.models.gpt2.GPT2Config")."""
        return f"{self.config.__module__}.{self.config.__qualname__}"

    def canonical(self, key: str) -> str:
        """A checkpoint key of any supported variant -> the name in ``architecture``'s checkpoint."""
        for old, new in _LEGACY_SUFFIXES.items():
            if key.endswith(old):
                key = key[: -len(old)] + new
        if key.startswith(self.base_prefix) or key.startswith(self.head_prefixes):
            return key
        return self.base_prefix + key

    def read_plan(self, name: str, config) -> tuple[bool, Any]:
        """(transposed, row map) of shardzoo tensor ``name`` in its checkpoint tensor."""
        return self.hf_read_plan(name, config) if self.hf_read_plan is not None else (False, None)

    def hf_config(self, config) -> dict:
        """config.json contents for ``config`` (a shardzoo config dataclass)."""
        data = config.to_dict()
        data.update(model_type=self.model_type, architectures=[self.architecture])
        return data

    def config_from_json(self, data: dict):
        """A saved config dict -> this family's config (CheckpointError naming the bad field)."""
        return self.config.from_json(data)

    def to_hf(self, name: str, tensor: torch.Tensor, config) -> list[tuple[str, torch.Tensor]]:
        """One saved (shardzoo-named, full-size) tensor -> its Hugging Face ``[(name, tensor)]``."""
        return self.shardzoo_to_hf(name, tensor, config=config)

    def export_adapter(self) -> ExportAdapter:
        """What ``checkpoint.export_plain`` needs to give this family's checkpoints Hugging Face
        names and config.json."""
        return ExportAdapter(config_class=self.config_path, config_from_json=self.config_from_json,
                             to_hf=self.to_hf, hf_config=self.hf_config)


_REGISTRY: dict[str, FamilySpec] = {}
REGISTRY = types.MappingProxyType(_REGISTRY)  # name -> spec, read-only and always current


def register(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` to the registry (replacing one of the same name) and register its
    checkpoint export adapter, so ``shardzoo convert`` gives its checkpoints Hugging Face names."""
    _REGISTRY[spec.name] = spec
    register_export_adapter(spec.export_adapter())
    return spec


def all_specs() -> list[FamilySpec]:
    """Every registered family, sorted by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def family_names() -> list[str]:
    """The registered families' names, sorted."""
    return sorted(_REGISTRY)


def spec_named(name: str) -> FamilySpec:
    """The family called ``name`` (case and hyphens ignored: "GPT-2" is "gpt2"); ValueError
    naming the registered ones otherwise."""
    key = name.lower().replace("-", "")
    if key not in _REGISTRY:
        raise ValueError(f"unknown model family {name!r}; choose one of {family_names()}")
    return _REGISTRY[key]


def spec_of(obj) -> FamilySpec:
    """The family of a model or config (an instance or a class). The class's bases are
    searched in method resolution order, so a subclass of a family's model or config belongs
    to that family."""
    cls = obj if isinstance(obj, type) else type(obj)
    for base in cls.__mro__:
        for spec in _REGISTRY.values():
            if base is spec.model or base is spec.config:
                return spec
    raise ValueError(f"{cls.__name__} is not a model or config of a registered family ({family_names()}); "
                     f"Hugging Face loading and export know only those (register a FamilySpec to add one)")

