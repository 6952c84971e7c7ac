"""Base of the config dataclasses: fields named as in each family's Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class HFConfig:
    """Mixin for dataclasses whose fields mirror a Hugging Face ``config.json``."""

    @classmethod
    def from_json(cls, path_or_dict: str | os.PathLike | dict[str, Any]):
        """From a ``config.json`` path, a directory holding one, or a dict (e.g. an HF
        ``config.to_dict()``). Keys that are not fields of this config are ignored."""
        if isinstance(path_or_dict, dict):
            data = path_or_dict
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                data = json.load(f)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
