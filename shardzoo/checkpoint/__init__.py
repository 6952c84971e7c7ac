"""Sharded checkpoints: save from any layout, load into any other, export plain weights.

    from shardzoo import checkpoint

    checkpoint.save(model, "ckpt/step-1000", optimizer)   # every rank; records model.config
    checkpoint.load(model, "ckpt/step-1000", optimizer)   # any mesh / world size
    checkpoint.export_plain("ckpt/step-1000", "hf-out")   # one process

The format, the writer rule, atomicity and verification are described in docs/checkpoint.md.
"""

from shardzoo.checkpoint.adapters import ExportAdapter, register_export_adapter
from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.exporting import export_plain
from shardzoo.checkpoint.index import read_index
from shardzoo.checkpoint.loading import LoadResult, load
from shardzoo.checkpoint.saving import save

__all__ = ["CheckpointError", "ExportAdapter", "LoadResult", "export_plain", "load", "read_index",
           "register_export_adapter", "save"]
