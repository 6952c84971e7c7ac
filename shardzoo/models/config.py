"""Base of the config dataclasses: fields named as in each family's Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

from shardzoo.layers.mlp import ACTIVATIONS

ACTIVATION_NAMES = tuple(sorted(ACTIVATIONS))


class HFConfig:
    """Mixin for dataclasses whose fields mirror a Hugging Face ``config.json``.

    ``SUPPORTED`` lists Hugging Face options that change the numerics, with the values
    shardzoo implements; :meth:`from_json` refuses any other value rather than build a model
    that silently computes something else."""

    SUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @classmethod
    def from_json(cls, path_or_dict: str | os.PathLike | dict[str, Any]):
        """From a ``config.json`` path, a directory holding one, or a dict (e.g. an HF
        ``config.to_dict()``). Keys that are not fields of this config are ignored, except
        the options of ``SUPPORTED``, which must hold a supported value."""
        data = read_json(path_or_dict)
        cls.check_supported(data)
        return cls(**cls.fields_from(data))

    @classmethod
    def fields_from(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments found in a config dict (families may derive more)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in data.items() if k in names}

    @classmethod
    def check_supported(cls, data: dict[str, Any]) -> None:
        for key, allowed in cls.SUPPORTED.items():
            if key in data and data[key] not in allowed:
                raise ValueError(
                    f"{cls.__name__}: {key}={data[key]!r} is not implemented by shardzoo, and it changes the model's "
                    f"numerics (shardzoo supports {key} in {list(allowed)}); use a checkpoint whose config.json sets "
                    f"{key} to one of those, or leave the key out")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_json(path_or_dict: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """A config dict from a dict, a ``config.json`` path or a directory holding one."""
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)
