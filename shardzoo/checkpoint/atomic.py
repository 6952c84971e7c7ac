"""Directory swap that makes a save all-or-nothing, and the marks that say which directories
a save wrote.

Shards and the index are written into ``<dir>.tmp-<token>`` next to ``<dir>`` (``token``: 12 hex
digits). That directory holds a marker file, ``.shardzoo-save``, which rank 0 keeps locked
(``flock``) for the whole save, and which travels with the directory when it becomes ``<dir>``.
Only when every rank has written and fsynced its shard does rank 0 write the index (last),
fsync, and swap the new directory with ``<dir>`` in one step (``renameat2(RENAME_EXCHANGE)``
on Linux; elsewhere ``<dir>`` is first renamed aside to ``<dir>.old-<token>``), then remove the
previous checkpoint. A crash before the swap leaves ``<dir>`` untouched and a temp dir without
an index (not a loadable checkpoint); a crash between the two renames of the fallback leaves the
previous checkpoint in ``<dir>.old-<token>``, which the next save moves back.

A sibling is removed or moved back only if a save wrote it: its name is exactly
``<dir>.tmp-<token>`` / ``<dir>.old-<token>``, it holds the marker, and no running save holds the
marker's lock. A locked one means another save into ``<dir>`` is running: the save is refused.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.index import INDEX_NAME

try:
    import fcntl
except ImportError:  # no flock (Windows): saves are not protected against running at once
    fcntl = None

MARKER = ".shardzoo-save"
_MARKER_TEXT = b"a directory written by shardzoo.checkpoint.save; saves may remove or replace it\n"
_TOKEN = re.compile(r"[0-9a-f]{12}")


class Staging:
    """The temp dir of a save being written, and the open, locked marker file that marks it."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


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


def _marked(path: str) -> bool:
    marker = os.path.join(path, MARKER)
    return not os.path.islink(path) and os.path.isdir(path) and os.path.isfile(marker) and not os.path.islink(marker)


def _siblings(final: str, kind: str) -> list[str]:
    """The marked ``<final>.<kind>-<token>`` directories next to ``final``."""
    parent, base = os.path.split(final)
    prefix = f"{base}.{kind}-"
    names = [n for n in sorted(os.listdir(parent)) if n.startswith(prefix) and _TOKEN.fullmatch(n[len(prefix):])]
    return [os.path.join(parent, n) for n in names if _marked(os.path.join(parent, n))]


def _lock(fd: int) -> bool:
    """Take the exclusive lock of marker ``fd`` without waiting; False when a save holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _in_use(path: str) -> bool:
    """Whether a running save holds the marker of directory ``path``."""
    try:
        fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return not _lock(fd)
    finally:
        os.close(fd)


def _mark(path: str, lock: bool) -> int:
    """Write the marker of directory ``path``, locked first when ``lock`` (it is created under
    another name and renamed, so no other save ever sees it unlocked); returns its open fd."""
    part = os.path.join(path, MARKER + ".new")
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        if lock:
            _lock(fd)
        os.write(fd, _MARKER_TEXT)
        os.rename(part, os.path.join(path, MARKER))
    except BaseException:
        os.close(fd)
        raise
    return fd


def prepare(final: str, token: str) -> Staging:
    """Check ``final`` may be replaced, create and lock the temp dir, refuse when another save
    into ``final`` is running, then restore / remove what earlier saves left. Run on rank 0 only."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(final):
        if not os.path.isdir(final):
            raise CheckpointError(f"{final} exists and is a file; choose a directory path for the checkpoint")
        if os.listdir(final) and not os.path.isfile(os.path.join(final, INDEX_NAME)):
            raise CheckpointError(f"{final} exists, is not empty and is not a shardzoo checkpoint (no {INDEX_NAME}); "
                                  f"saving would replace its contents. Choose another directory or empty it")
    tmp = f"{final}.tmp-{token}"
    try:
        os.makedirs(tmp)
        staging = Staging(tmp, _mark(tmp, lock=True))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{tmp}: cannot create the save's temp directory ({e.strerror or type(e).__name__}); free "
                              f"space or fix the file system's permissions, then save again") from None
    try:
        busy = [d for d in _siblings(final, "tmp") if d != tmp and _in_use(d)]
        if busy:
            raise CheckpointError(f"another save into {final} is running (its temp dir {busy[0]} is in use); wait for "
                                  f"it to finish, or save into another directory")
        if not os.path.exists(final):
            for old in _siblings(final, "old"):  # a swap was interrupted: bring the previous checkpoint back
                if os.path.isfile(os.path.join(old, INDEX_NAME)) and not _in_use(old):
                    os.rename(old, final)
                    break
        for leftover in _siblings(final, "tmp") + _siblings(final, "old"):
            if leftover != tmp and not _in_use(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
    except BaseException:
        discard(staging)
        raise
    return staging


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Swap paths ``a`` and ``b`` in one step (Linux ``renameat2``); False where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # a file system without it
    raise OSError(err, os.strerror(err), b)


def commit(staging: Staging, final: str, token: str) -> None:
    """Swap the finished temp dir (index already written) into place of ``final``."""
    final = os.path.abspath(final)
    tmp = staging.path
    fsync_dir(tmp)
    old = None
    if not os.path.exists(final):
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        old = tmp  # now holds the previous checkpoint
    else:
        if not _marked(final):  # a checkpoint from before markers: mark it so a crash here can be undone
            os.close(_mark(final, lock=False))
        old = f"{final}.old-{token}"
        os.rename(final, old)
        os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    staging.release()
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(staging: Staging | None) -> None:
    """Remove an unfinished temp dir (after a failed save) and drop its lock."""
    if staging is not None:
        shutil.rmtree(staging.path, ignore_errors=True)
        staging.release()
