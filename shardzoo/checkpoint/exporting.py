"""``export_plain``: a sharded checkpoint -> plain safetensors weights in the Hugging Face layout.

Names: when the index's ``config_class`` is one of shardzoo's model families (GPT-2, BERT, ViT,
OPT), every tensor goes through that family's ``shardzoo_to_hf`` and ``config.json`` is the
family's Hugging Face config, so ``transformers`` loads the output directly. The family is
known through the export adapter it registers (adapters.py): this package imports no model code.
``names="shardzoo"`` (and any checkpoint of another model) keeps the saved names and config. A
``rename`` hook replaces the family's mapping.

A tensor the model stored reshaped (the index's ``serial_shape``, e.g. a fused q/k/v weight kept
as [in, 3, n]) is exported in its serial shape.

Streaming, tensor by tensor, with the output headers planned up front (the mapping is first run
on meta tensors). Each output tensor is written at its known position in its file:

* a tensor the mapping passes through unchanged (same tensor object) whose pieces are each one
  contiguous byte run of the full tensor (whole, or split along its first split dim only) is
  copied byte for byte from the shard files (``os.copy_file_range``: inside the kernel, never
  decoded; ``bytecopy.py``);
* anything else (a transpose, a fused-QKV split, pieces split along a later dim) is assembled
  into one full tensor from memory-mapped pieces, mapped, and written from memory.

Every piece's crc32 is checked on a worker thread over the memory-mapped shard bytes while the
main thread copies; another thread starts the writeback of each 64 MiB written, so the closing
fsync waits for little. Every output file is written as ``<name>.partial`` and fsynced; only when
all of them are written and every piece passed its check are they renamed into place, config.json
last (export_files.py), so a failed export leaves the previous output as it was and a killed one
never leaves a directory that looks complete. Memory: about one global tensor (plus what the
mapping makes of it) on the decoding path, nothing on the copying path.
"""

from __future__ import annotations

import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from shardzoo.checkpoint.adapters import export_adapter
from shardzoo.checkpoint.bytecopy import Shards, assemble, check_covered, copy_tensor, pwritev_all
from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.export_files import (CONFIG_FILE, INDEX_FILE, Out, OutFile, layout_files, make_dir, publish,
                                              remove_partial, write_hf_index, write_json)
from shardzoo.checkpoint.index import INDEX_NAME, read_index
from shardzoo.checkpoint.reading import entries_of, keys_by_file, shard_header, verify
from shardzoo.checkpoint.safetensors_io import ST_DTYPES, dtype_from_name, dtype_name, nbytes, tensor_bytes, write_error

Rename = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default shard size ("5GB")
NAMES = ("hf", "shardzoo")


def _mapping(index: dict, names: str, rename: Rename | None, where: str | None = None) -> tuple[Rename | None, dict | None]:
    """The hook to apply to each saved tensor and the contents of config.json; ``where`` (the
    index file) prefixes the error when the saved config is not a valid config of its family."""
    if names not in NAMES:
        raise ValueError(f"names={names!r}; choose 'hf' (Hugging Face names for shardzoo's model families) or 'shardzoo'")
    if names == "shardzoo" and rename is not None:
        raise ValueError("names='shardzoo' exports the saved names unchanged; drop rename= or use names='hf'")
    config = index.get("config")
    if names == "shardzoo" or config is None:
        return rename, config
    adapter = export_adapter(index.get("config_class"))
    if adapter is None:  # not a registered model family: the saved names are the only names there are
        return rename, config
    try:
        typed = adapter.config_from_json(config)
    except CheckpointError as e:
        if where is None:
            raise
        raise CheckpointError(f"{where}, config: {e}") from None
    return rename or functools.partial(adapter.to_hf, config=typed), adapter.hf_config(typed)


def has_hf_names(index: dict) -> bool:
    """Whether ``names="hf"`` gives checkpoint ``index`` Hugging Face names and a Hugging Face
    config.json (it was saved with the config of a shardzoo model family)."""
    return _mapping(index, "hf", None)[0] is not None


def _serial_shape(entry: dict) -> list[int]:
    """The shape the serial model gives a saved tensor: its ``serial_shape`` when it was stored
    reshaped (the same elements in the same row-major order, so its bytes are copied as they are)."""
    return entry.get("serial_shape") or entry["shape"]


def _plan(index: dict, rename: Rename | None) -> list[tuple[str, list[Out]]]:
    """Per source tensor, the outputs it maps to: ``rename`` run on meta tensors, so the output
    headers are known before any data is read."""
    plan, seen = [], {}
    for name, entry in index["tensors"].items():
        meta = torch.empty(_serial_shape(entry), dtype=dtype_from_name(entry["dtype"]), device="meta")
        try:
            outs = rename(name, meta) if rename is not None else [(name, meta)]
        except Exception as e:
            raise CheckpointError(f"rename({name!r}, tensor) failed on a shape-only (meta) tensor: {type(e).__name__}: {e}. "
                                  f"The hook must use torch ops only (no .item(), .numpy() or data-dependent code)") from e
        row = []
        for out_name, t in outs:
            if out_name in seen:
                raise CheckpointError(f"rename maps both {seen[out_name]!r} and {name!r} to {out_name!r}; output names must be unique")
            if t.dtype not in ST_DTYPES:
                raise CheckpointError(f"tensor {out_name!r} has dtype {t.dtype}, which safetensors cannot store; "
                                      f"cast it to one of {', '.join(dtype_name(d) for d in ST_DTYPES)}")
            seen[out_name] = name
            row.append(Out(out_name, t.dtype, tuple(t.shape), same=t is meta))
        plan.append((name, row))
    return plan


class _Progress:
    """tqdm when it is installed, else a line every ~10% on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self._bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="tensor", desc="export")
            except ImportError:
                pass

    def step(self, name: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"export: {self.done}/{self.total} tensors ({name})", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def export_plain(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, names: str = "hf",
                 rename: Rename | None = None, progress: bool = True) -> list[str]:
    """Write the model tensors of checkpoint ``ckpt_dir`` as plain safetensors into ``out_dir``.

    One process; memory about one global tensor (plus what the mapping makes of it).

    Args:
        ckpt_dir: a checkpoint written by :func:`shardzoo.checkpoint.save`.
        out_dir: output directory (created); existing files of the same names are replaced.
        max_shard_bytes: largest output file before splitting into ``model-0000i-of-0000N``.
        names: ``"hf"``: a checkpoint of a shardzoo model family (GPT-2, BERT, ViT, OPT; known
            from the index's ``config_class``) gets that family's Hugging Face names and layouts
            and a Hugging Face ``config.json``, which ``transformers`` loads with
            ``from_pretrained``; other checkpoints keep their names. ``"shardzoo"``: the saved
            names and config, unchanged.
        rename: ``rename(name, tensor) -> [(new_name, new_tensor), ...]``, a mapping of your own
            used instead of the family's (may split, transpose, drop: return []). It is first
            called on meta tensors to plan the files, so it must use torch ops only; an output
            that is the input tensor object itself is copied without decoding.
        progress: show a progress bar (tqdm if installed, else a counter on stderr).

    Returns:
        The paths written.
    """
    index = read_index(ckpt_dir)
    hook, config_json = _mapping(index, names, rename, where=os.path.join(ckpt_dir, INDEX_NAME))
    entries = entries_of(index, ("model",))
    verify(ckpt_dir, index, entries, 0, 1, checksums=False)  # sizes now; headers and crc32 as pieces are read
    for file, listed in keys_by_file(index).items():  # every listed file holds exactly the pieces placed there
        shard_header(ckpt_dir, file, listed)
    plan = _plan(index, hook)
    make_dir(out_dir)
    files = layout_files(plan, max_shard_bytes, out_dir)
    index_path = os.path.join(out_dir, INDEX_FILE) if len(files) > 1 else None
    config_path = os.path.join(out_dir, CONFIG_FILE) if config_json is not None else None
    written = [f.path for f in files] + [p for p in (index_path, config_path) if p is not None]  # config.json last
    try:
        _write_weights(ckpt_dir, index, plan, files, hook, progress)
        if index_path is not None:
            write_hf_index(files, index_path)
        if config_path is not None:
            write_json(config_path, config_json)
        publish(out_dir, written)
    except BaseException:
        for path in written:
            remove_partial(path)
        raise
    return written


def _write_weights(ckpt_dir: str, index: dict, plan, files: list[OutFile], hook, progress: bool) -> None:
    """Write every output tensor into its file (module docstring); each file is renamed into
    place when complete, and on any error the unfinished ones are removed."""
    shards = Shards(ckpt_dir, index)
    flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardzoo-writeback")
    bar = _Progress(len(plan), progress)
    current: list[OutFile] = []

    def output(out: Out) -> OutFile:
        return opened(files[out.file_no])

    def opened(f: OutFile) -> OutFile:
        if f.fd < 0:
            current.append(f)
            f.open()
        return f

    def finish(f: OutFile) -> None:
        shards.wait_checks()  # every piece copied into it so far passed its crc32 check
        f.finish()
        current.remove(f)

    name = None
    try:
        for name, row in plan:
            entry = index["tensors"][name]
            check_covered(name, entry)
            if not (all(out.same for out in row) and copy_tensor(shards, name, entry, [(output(o).fd, o.start) for o in row])):
                full = assemble(shards, name, entry).reshape(_serial_shape(entry))
                outs = hook(name, full) if hook is not None else [(name, full)]
                if [(n, t.dtype, tuple(t.shape)) for n, t in outs] != [(o.name, o.dtype, o.shape) for o in row]:
                    raise CheckpointError(f"rename({name!r}) returned {[(n, tuple(t.shape)) for n, t in outs]} on real data "
                                          f"but {[(o.name, o.shape) for o in row]} on meta tensors; it must not depend on values")
                for out, (_, t) in zip(row, outs):
                    pwritev_all(output(out).fd, [tensor_bytes(t)], out.start)
                del full, outs
            for out in row:
                f = output(out)
                f.left -= 1
                if f.left == 0:
                    finish(f)
                else:
                    f.written_up_to(out.start + nbytes(out.shape, out.dtype), flusher)
            bar.step(name)
        if not files[0].outs:  # a model without tensors: still a valid (empty) file
            finish(opened(files[0]))
    except OSError as e:  # a write or copy into an output file (ENOSPC, EIO, ...)
        raise write_error(" / ".join(f.path + ".partial" for f in current) or os.path.dirname(files[0].path), e) from None
    finally:
        for f in list(current):
            f.discard()
        bar.close()
        shards.close()
        flusher.shutdown(wait=True)
