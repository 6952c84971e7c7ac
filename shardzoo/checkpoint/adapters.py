"""Export adapters: how ``export_plain`` gives a model family's checkpoint Hugging Face names.

The checkpoint package sits below the models (docs/design.md, "Package layering"), so it holds
only this registry; each model family registers its adapter when ``shardzoo.models`` is
imported, and ``import shardzoo`` imports ``shardzoo.models``, so every entry point finds them.
A model of your own can register one for its config class the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardzoo.checkpoint.errors import CheckpointError

ToHF = Callable[[str, torch.Tensor, Any], list[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ExportAdapter:
    """One model family, as ``export_plain`` needs it.

    Attributes:
        config_class: the class path the index records as ``config_class``
            (``"shardzoo.models.gpt2.GPT2Config"``): checkpoints saved with it use this adapter.
        config_from_json: the saved config dict -> the config object (raises CheckpointError
            naming the field when the dict is not a valid config).
        to_hf: ``(name, full tensor, config) -> [(hf_name, tensor), ...]``, one saved tensor at a
            time; first run on meta tensors, so torch ops only.
        hf_config: the config object -> the contents of Hugging Face's ``config.json``.
    """

    config_class: str
    config_from_json: Callable[[dict], Any]
    to_hf: ToHF
    hf_config: Callable[[Any], dict]


_ADAPTERS: dict[str, ExportAdapter] = {}
OWN_PREFIX = "shardzoo."  # a config class of shardzoo itself is a model family's: it must have an adapter


def register_export_adapter(adapter: ExportAdapter) -> None:
    """Make ``export_plain(names="hf")`` use ``adapter`` for checkpoints saved with its config
    class (a later registration for the same class replaces the earlier one)."""
    _ADAPTERS[adapter.config_class] = adapter


def export_adapter(config_class: str | None) -> ExportAdapter | None:
    """The adapter registered for ``config_class``; None for a config of another model (its
    checkpoint keeps the saved names). A config class of shardzoo's own without an adapter
    means the model families were never registered: an error, not a silent rename-less export."""
    adapter = _ADAPTERS.get(config_class) if config_class is not None else None
    if adapter is None and config_class is not None and config_class.startswith(OWN_PREFIX):
        raise CheckpointError(
            f"config_class {config_class!r} has no export adapter registered; every config class of shardzoo "
            f"is a model family, and the families register theirs when shardzoo.models is imported "
            f"(registered now: {sorted(_ADAPTERS) or 'none'}). Import shardzoo.models before exporting "
            f"(import shardzoo does), or pass names='shardzoo' to keep the saved names")
    return adapter
