"""Base of the config dataclasses: fields named as in each family's Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, ClassVar

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.jsontypes import fail, kind, load_json_file, obj
from shardzoo.checkpoint.paths import resolve_in, show
from shardzoo.models.plain import ACTIVATION_NAMES  # noqa: F401  (the families' activations)

MAX_SIZE = 2**31 - 1  # bound of every size in a config (vocabulary, width, positions, ...)
_HF_OBJECTS = ("id2label", "label2id")  # Hugging Face keys families may read that hold objects


class HFConfig:
    """Mixin for dataclasses whose fields mirror a Hugging Face ``config.json``.

    ``SUPPORTED`` lists Hugging Face options that change the numerics, with the values
    shardzoo implements; :meth:`from_json` refuses any other value rather than build a model
    that silently computes something else."""

    SUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @classmethod
    def from_json(cls, path_or_dict: str | os.PathLike | dict[str, Any], *, source: str | None = None):
        """From a ``config.json`` path, a directory holding one, or a dict (e.g. an HF
        ``config.to_dict()``). Keys that are not fields of this config are ignored, except
        the options of ``SUPPORTED``, which must hold a supported value. Every field's JSON type
        and range is checked (:func:`check_fields`); errors are CheckpointError naming ``source``
        (the file; by default the path, or the class name for a dict) and the field."""
        data, where = read_json(path_or_dict)
        where = source or where or cls.__name__
        obj(data, where, optional=None)
        for key in _HF_OBJECTS:
            if data.get(key) is not None:
                obj(data[key], f"{where}, {key}", optional=None)
        cls.check_supported(data, where)
        fields = cls.fields_from(data)
        check_fields(cls, fields, where)
        return cls(**fields)

    @classmethod
    def fields_from(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments found in a config dict (families may derive more)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in data.items() if k in names}

    @classmethod
    def check_supported(cls, data: dict[str, Any], where: str | None = None) -> None:
        for key, allowed in cls.SUPPORTED.items():
            if key in data and not any(type(data[key]) is type(a) and data[key] == a for a in allowed):
                prefix = f"{where}: " if where and where != cls.__name__ else ""
                raise CheckpointError(
                    f"{prefix}{cls.__name__}: {key}={show(data[key])} is not implemented by shardzoo, and it changes the "
                    f"model's numerics (shardzoo supports {key} in {list(allowed)}); use a checkpoint whose config.json sets "
                    f"{key} to one of those, or leave the key out")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_json(path_or_dict: str | os.PathLike | dict[str, Any]) -> tuple[Any, str | None]:
    """(config value, the file it came from) for a dict, a ``config.json`` path or a directory
    holding one (a file read as untrusted input: any JSON value may come back)."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, None
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = resolve_in(path, "config.json", source=f"config directory {path}")
    return load_json_file(path), path


def _allowed(hint) -> tuple[type, ...]:
    """The Python types a field annotated ``hint`` accepts (``int | None`` -> (int, NoneType))."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for h in typing.get_args(hint) for t in _allowed(h))
    return (hint,)


def _check_value(name: str, value, allowed: tuple[type, ...], where: str) -> None:
    if value is None:
        if type(None) not in allowed:
            fail(where, f"field {name} must not be null")
        return
    if bool in allowed:
        if not isinstance(value, bool):
            fail(where, f"field {name} must be true or false, is {kind(value)}")
    elif int in allowed:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(where, f"field {name} must be an integer, is {kind(value)}")
        lo = 0 if name.endswith("_id") else 1  # token ids may be 0; sizes and counts may not
        if not lo <= value <= MAX_SIZE:
            fail(where, f"field {name} must be between {lo} and {MAX_SIZE}")
    elif float in allowed:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(where, f"field {name} must be a finite number, is {kind(value)}")
        if any(w in name for w in ("dropout", "pdrop", "prob")) and not 0 <= value <= 1:
            fail(where, f"field {name} is a probability and must be between 0 and 1")
        if any(w in name for w in ("eps", "epsilon")) and not value > 0:
            fail(where, f"field {name} must be positive")
        if value < 0:
            fail(where, f"field {name} must not be negative")
    elif str in allowed and not isinstance(value, str):
        fail(where, f"field {name} must be a string, is {kind(value)}")


def check_fields(cls, fields: dict[str, Any], where: str) -> None:
    """Each value in ``fields`` against the type of the dataclass field of ``cls`` it sets:
    booleans, integers (sizes from 1, ``*_id`` from 0, up to MAX_SIZE), finite non-negative
    numbers (dropouts in [0, 1], epsilons above 0), strings; ``X | None`` also takes null."""
    hints = typing.get_type_hints(cls)
    for name, value in fields.items():
        _check_value(name, value, _allowed(hints[name]), where)
