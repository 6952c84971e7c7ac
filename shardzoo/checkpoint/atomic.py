"""Directory swap that makes a save all-or-nothing.

Shards and the index are written into ``<dir>.tmp-<token>`` next to ``<dir>``; only when every
rank has written and fsynced its shard does rank 0 write the index (last), fsync, move the old
``<dir>`` aside to ``<dir>.old-<token>``, rename the new one in, and remove the old one. A
crash before the swap leaves ``<dir>`` untouched and a temp dir without an index (not a
loadable checkpoint); the next save removes such leftovers. A crash in the middle of the swap
leaves the previous checkpoint in ``<dir>.old-<token>``, which the next save moves back.
"""

from __future__ import annotations

import os
import shutil

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import INDEX_NAME


def fsync_dir(path: str) -> None:
    """Persist a directory's entries (file creations and renames inside it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


def _siblings(final: str, kind: str) -> list[str]:
    parent, base = os.path.split(final)
    prefix = f"{base}.{kind}-"
    return [os.path.join(parent, n) for n in sorted(os.listdir(parent)) if n.startswith(prefix)]


def prepare(final: str, token: str) -> str:
    """Check ``final`` may be replaced, clean leftovers of earlier saves, create the temp dir.

    Returns the temp dir path. Run on rank 0 only."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(final):
        if not os.path.isdir(final):
            raise CheckpointError(f"{final} exists and is a file; choose a directory path for the checkpoint")
        if os.listdir(final) and not os.path.isfile(os.path.join(final, INDEX_NAME)):
            raise CheckpointError(f"{final} exists, is not empty and is not a shardzoo checkpoint (no {INDEX_NAME}); "
                                  f"saving would replace its contents. Choose another directory or empty it")
    else:
        for old in _siblings(final, "old"):  # a swap was interrupted: bring the previous checkpoint back
            if os.path.isfile(os.path.join(old, INDEX_NAME)):
                os.rename(old, final)
                break
    for leftover in _siblings(final, "tmp") + _siblings(final, "old"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = f"{final}.tmp-{token}"
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, final: str, token: str) -> None:
    """Swap the finished ``tmp`` (index already written) into place of ``final``."""
    final = os.path.abspath(final)
    fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{token}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(tmp: str | None) -> None:
    """Remove an unfinished temp dir (after a failed save)."""
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
