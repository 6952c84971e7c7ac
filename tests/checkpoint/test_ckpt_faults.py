"""Faults during save and export: a full disk or an I/O error on any write, a process killed
(SIGKILL) at several points, two saves into one directory at once, a bit flipped after save.
The previous checkpoint stays loadable, a half-written one is refused or cleaned up by the next
save, an export directory never looks complete unless it is."""

import contextlib
import errno
import os
import random
import shutil
import signal
import time

import pytest
import torch

from shardzoo import checkpoint
from shardzoo.checkpoint import CheckpointError, export_plain
from support.checkpoint_stack import run, save_stack, serial_stack

_WRITES = ("write", "pwrite", "pwritev", "copy_file_range", "replace")


@contextlib.contextmanager
def failing_writes(monkeypatch, err: int, after: int, calls: list | None = None):
    """Every os-level write call (and rename into place) after the first ``after`` raises
    OSError(``err``); ``calls`` collects the names of the calls made."""
    count = [0]
    calls = [] if calls is None else calls

    def wrap(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            count[0] += 1
            if count[0] > after:
                raise OSError(err, os.strerror(err))
            return real(*args, **kwargs)
        return call

    with monkeypatch.context() as m:
        for name in _WRITES:
            if hasattr(os, name):
                m.setattr(os, name, wrap(name, getattr(os, name)))
        yield calls


def values(ckpt) -> torch.Tensor:
    model = serial_stack(0)
    checkpoint.load(model, ckpt)
    return model.fc1.weight.detach().clone()


def expected(seed) -> torch.Tensor:
    return serial_stack(seed).fc1.weight.detach()


def count_writes(monkeypatch, fn) -> int:
    with failing_writes(monkeypatch, errno.ENOSPC, after=10**9) as calls:
        fn()
    return len(calls)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_write_error_during_save_keeps_previous(tmp_path, monkeypatch, err):
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(serial_stack(1), ckpt)
    total = count_writes(monkeypatch, lambda: checkpoint.save(serial_stack(1), ckpt))
    assert total >= 4  # marker, shard header, tensors, index
    for after in sorted({0, 1, 2, total // 2, total - 1}):
        with pytest.raises(CheckpointError) as info, failing_writes(monkeypatch, err, after):
            checkpoint.save(serial_stack(2), ckpt)
        assert os.strerror(err) in str(info.value) and ".tmp-" in str(info.value), (after, str(info.value))
        assert sorted(os.listdir(tmp_path)) == ["ckpt"], after
        assert torch.equal(values(ckpt), expected(1)), after


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_write_error_during_export_keeps_previous_output(tmp_path, monkeypatch, err):
    """Several output files (small max_shard_bytes); any failing write or rename leaves the
    previous export complete and untouched, or (failing while publishing) a directory without
    config.json; no partial file stays."""
    old, new, out = str(tmp_path / "old"), str(tmp_path / "new"), str(tmp_path / "out")
    checkpoint.save(serial_stack(1), old, config={"seed": 1})
    checkpoint.save(serial_stack(2), new, config={"seed": 2})
    export_plain(old, out, max_shard_bytes=600, progress=False)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    total = count_writes(monkeypatch, lambda: export_plain(old, out, max_shard_bytes=600, progress=False))
    for after in range(total):
        with pytest.raises(CheckpointError) as info, failing_writes(monkeypatch, err, after) as calls:
            export_plain(new, out, max_shard_bytes=600, progress=False)
        assert os.strerror(err) in str(info.value) and out in str(info.value), (after, str(info.value))
        names = sorted(os.listdir(out))
        assert not any(n.endswith(".partial") for n in names), (after, names)
        if calls[-1] != "replace":  # failed before publishing: the previous export, as it was
            assert {n: open(os.path.join(out, n), "rb").read() for n in names} == before, after
        else:
            assert "config.json" not in names, (after, names)
    export_plain(new, out, max_shard_bytes=600, progress=False)
    assert '"seed": 2' in open(os.path.join(out, "config.json")).read()


def killed_at(module, attr, fn, *, after_original: bool = False, nth: int = 1) -> None:
    """Run ``fn`` in a forked child that SIGKILLs itself at the ``nth`` call of
    ``module.attr`` (before it runs, or right after it returns with ``after_original``)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            real, seen = getattr(module, attr), [0]

            def call(*args, **kwargs):
                seen[0] += 1
                if seen[0] == nth and not after_original:
                    os.kill(os.getpid(), signal.SIGKILL)
                out = real(*args, **kwargs)
                if seen[0] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
                return out
            setattr(module, attr, call)
            fn()
        finally:
            os._exit(7)  # reached only when the kill point was never hit
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{attr}: exit status {status}"


def _kill_points():
    from shardzoo.checkpoint import atomic, safetensors_io, saving

    return {
        "mid-shard": (safetensors_io.SafetensorsWriter, "write", dict(nth=2)),
        "before-index": (saving, "write_json_durably", {}),
        "index-written": (atomic, "commit", {}),
        # the swap without renameat2: the marker's rename in prepare is the first call
        "between-renames": (os, "rename", dict(after_original=True, nth=2)),
        "after-swap": (atomic.shutil, "rmtree", {}),
    }


@pytest.mark.parametrize("point", ["mid-shard", "before-index", "index-written", "between-renames", "after-swap"])
def test_killed_save(tmp_path, monkeypatch, point):
    from shardzoo.checkpoint import atomic

    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(serial_stack(1), ckpt)
    if point == "between-renames":
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    module, attr, how = _kill_points()[point]
    killed_at(module, attr, lambda: checkpoint.save(serial_stack(2), ckpt), **how)
    leftovers = sorted(n for n in os.listdir(tmp_path) if n != "ckpt")
    if point == "between-renames":  # the previous checkpoint aside, the new one complete in its temp dir
        assert [n[:9] for n in leftovers] == ["ckpt.old-", "ckpt.tmp-"] and not os.path.exists(ckpt), leftovers
    else:
        assert len(leftovers) == 1, leftovers
    leftover = str(tmp_path / leftovers[0])
    if point == "between-renames":  # load says where the previous checkpoint is
        with pytest.raises(CheckpointError, match=f"previous checkpoint is at {leftover}"):
            values(ckpt)
        assert torch.equal(values(leftover), expected(1))
    else:
        assert torch.equal(values(ckpt), expected(2 if point == "after-swap" else 1))
        if point in ("mid-shard", "before-index"):  # the half-written one is refused
            with pytest.raises(CheckpointError, match="has no index.json, so it is not a complete shardzoo checkpoint"):
                values(leftover)
    checkpoint.save(serial_stack(3), ckpt)  # the next save restores / cleans up
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(values(ckpt), expected(3))


@pytest.mark.parametrize("point", ["mid-copy", "publishing"])
def test_killed_export_never_looks_complete(tmp_path, point):
    from shardzoo.checkpoint import bytecopy

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    run("1d_tp2", save_stack, 4, ckpt)
    export = lambda: export_plain(ckpt, out, max_shard_bytes=600, progress=False)  # noqa: E731
    if point == "mid-copy":
        killed_at(bytecopy, "_copy", export, nth=3)
    else:
        killed_at(os, "replace", export, after_original=True, nth=2)
    names = os.listdir(out)
    assert "config.json" not in names and "model.safetensors.index.json" not in names, names
    export()
    assert "config.json" in os.listdir(out) and not any(n.endswith(".partial") for n in os.listdir(out))


def test_two_saves_at_once(tmp_path):
    """A save paused mid-write holds the directory: a second save is refused and the first
    completes; two saves racing end with one of the two complete checkpoints and nothing else."""
    from shardzoo.checkpoint import safetensors_io

    ckpt, go = str(tmp_path / "ckpt"), tmp_path / "go"
    checkpoint.save(serial_stack(1), ckpt)
    pid = os.fork()
    if pid == 0:
        try:
            real = safetensors_io.SafetensorsWriter.write

            def paused(self, key, t):
                while not go.exists():
                    time.sleep(0.01)
                return real(self, key, t)
            safetensors_io.SafetensorsWriter.write = paused
            checkpoint.save(serial_stack(2), ckpt)
            os._exit(0)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 60
    while not any(n.startswith("ckpt.tmp-") for n in os.listdir(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="another save into .* is running"):
        checkpoint.save(serial_stack(3), ckpt)
    assert torch.equal(values(ckpt), expected(1))
    go.touch()
    assert os.waitpid(pid, 0)[1] == 0
    assert torch.equal(values(ckpt), expected(2)) and sorted(os.listdir(tmp_path)) == ["ckpt", "go"]

    previous = 2
    for _ in range(3):  # racing: each ends saved or refused (both may refuse each other), never a mixture
        pids = []
        for seed in (4, 5):
            pid = os.fork()
            if pid == 0:
                try:
                    checkpoint.save(serial_stack(seed), ckpt)
                    os._exit(0)
                except CheckpointError:
                    os._exit(3)
                finally:
                    os._exit(1)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        assert set(codes) <= {0, 3}, codes
        got = values(ckpt)
        assert any(torch.equal(got, expected(s)) for s in [s for s, c in zip((4, 5), codes) if c == 0] or [previous])
        checkpoint.save(serial_stack(6), ckpt)
        previous = 6
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "go"]


def test_bit_flip_after_save_names_tensor_and_file(tmp_path):
    """One bit flipped anywhere in any piece's data: load and export name the tensor, the
    piece and the shard file (crc32)."""
    from shardzoo.checkpoint.safetensors_io import read_header

    ckpt = str(tmp_path / "ckpt")
    run("1d_tp2", save_stack, 6, ckpt)
    index = checkpoint.read_index(ckpt)
    rng = random.Random(0)
    for name, entry in index["tensors"].items():
        piece = rng.choice(entry["pieces"])
        if piece["bytes"] == 0:
            continue
        broken = str(tmp_path / f"broken-{name}")
        shutil.copytree(ckpt, broken)
        path = os.path.join(broken, piece["file"])
        header, data_start = read_header(path)
        at = data_start + header[piece["key"]]["data_offsets"][0] + rng.randrange(piece["bytes"])
        data = bytearray(open(path, "rb").read())
        data[at] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bytes(data))
        want = f"{path}: piece '{piece['key']}' of tensor '{name}' fails its crc32 check"
        with pytest.raises(CheckpointError) as info:
            checkpoint.load(serial_stack(0), broken)
        assert want in str(info.value)
        with pytest.raises(CheckpointError) as info:
            export_plain(broken, broken + "-out", progress=False)
        assert want in str(info.value)
        assert "config.json" not in os.listdir(broken + "-out")
