"""File names read from disk, resolved so that they never leave their directory.

Every name a reader takes from a file (a shard file named in ``index.json``, a weight file named
in ``model.safetensors.index.json``) and every fixed name it opens inside a directory
(``index.json``, ``config.json``, ``model.safetensors``) goes through :func:`resolve_in`, and so
does every name a writer creates in an output directory. The rule is the same for all: a plain
file name (no absolute path, no separator, not ``.`` / ``..``, no NUL byte) whose real path,
after following symlinks, is still inside the directory.

One exception keeps the Hugging Face hub cache usable: its ``snapshots/<revision>/`` directories
hold symlinks into the repository's ``blobs/`` directory, so for a directory laid out that way
(``<repo>/snapshots/<revision>`` next to ``<repo>/blobs``) targets inside ``<repo>/blobs`` are
accepted too.
"""

from __future__ import annotations

import os

from shardzoo.checkpoint.errors import CheckpointError

_SHOWN = 80  # characters of an offending name shown in a message


def show(text) -> str:
    """A name from a file, quoted and cut short for an error message."""
    shown = repr(text)
    return shown if len(shown) <= _SHOWN else shown[:_SHOWN - 5] + "...'" + f" ({len(str(text))} characters)"


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root and path != root


def _hub_blobs(real_dir: str) -> str | None:
    """``<repo>/blobs`` when ``real_dir`` is a hub cache ``<repo>/snapshots/<revision>``."""
    snapshots = os.path.dirname(real_dir)
    if os.path.basename(snapshots) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return blobs if os.path.isdir(blobs) else None


def resolve_in(directory: str | os.PathLike, name, *, source: str) -> str:
    """The path of file ``name`` inside ``directory``, refused unless it stays there.

    Args:
        directory: the directory the name is relative to.
        name: a file name as read from disk (any JSON value: it is checked here).
        source: what named it, for the message (e.g. ``"ckpt/index.json, tensors['w'].pieces[0].file"``).

    Returns:
        ``os.path.join(directory, name)`` (the file may not exist; callers check that).

    Raises:
        CheckpointError naming the source, the name and the rule it breaks.
    """
    directory = os.fspath(directory)
    if not isinstance(name, str):
        raise CheckpointError(f"{source}: a file name must be a string, not {type(name).__name__}")
    rule = None
    if name in ("", ".", ".."):
        rule = "is not a file name"
    elif "\x00" in name:
        rule = "contains a NUL byte"
    elif os.path.isabs(name) or name.startswith(("/", "\\")):
        rule = "is an absolute path; names read from disk must be plain file names inside the directory"
    elif "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        rule = "contains a path separator; names read from disk must be plain file names inside the directory"
    if rule is not None:
        raise CheckpointError(f"{source}: file name {show(name)} {rule}. The file that names it was edited or "
                              f"is not from this library; restore it from the original save")
    path = os.path.join(directory, name)
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(path)
    if _inside(real, real_dir):
        return path
    blobs = _hub_blobs(real_dir)
    if blobs is not None and _inside(real, os.path.realpath(blobs)):
        return path
    raise CheckpointError(f"{source}: {path} is a symlink whose target lies outside {directory}; files are read "
                          f"only from inside their directory. Replace the link with the file itself")
