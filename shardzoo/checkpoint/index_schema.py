"""index.json checked field by field before anything reads a shard (the format is in index.py).

Every field's JSON type and range is checked, and the pieces against each other: each piece
is a box inside its tensor's global shape, its byte count is its elements times the dtype's
size, its key is the one ``save`` gives it, it lives in a file listed in ``files`` (a plain name
inside the checkpoint directory, see paths.py), the pieces of a tensor tile it exactly (no gap,
no overlap), and the pieces in each file add up to no more bytes than the file holds. Since
``load`` / ``export_plain`` then check each file's size against ``files``, no reader allocates
or reads more than the files on disk hold, whatever the index says.
"""

from __future__ import annotations

import math

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.jsontypes import MAX_INT, array, fail, int_list, integer, kind, obj, optional_string, string
from shardzoo.checkpoint.paths import resolve_in, show
from shardzoo.checkpoint.safetensors_io import DTYPE_NAMES, nbytes

_REDO = "The index was edited or corrupted; restore it from the original save"
_SCALARS = (type(None), bool, int, float, str)


def _scalar_or_list(value, where: str) -> None:
    """An optimizer option or state value: a JSON scalar or an array of scalars."""
    items = value if isinstance(value, list) else [value]
    for v in items:
        if not isinstance(v, _SCALARS):
            fail(where, f"must be a number, string, boolean, null or an array of those, holds {kind(v)}")


def _overlap(pieces: list[tuple[list[int], list[int]]]) -> tuple[int, int] | None:
    """Indices of two pieces whose boxes share an element, else None (a sweep along dim 0)."""
    if not pieces or not pieces[0][0]:
        return (0, 1) if len([p for p in pieces if math.prod(p[1]) > 0]) > 1 else None
    order = sorted(range(len(pieces)), key=lambda i: pieces[i][0][0])
    for a, i in enumerate(order):
        lo_i, shape_i = pieces[i]
        if 0 in shape_i:
            continue
        for j in order[a + 1:]:
            lo_j, shape_j = pieces[j]
            if lo_j[0] >= lo_i[0] + shape_i[0]:
                break
            if 0 not in shape_j and all(max(x, y) < min(x + s, y + t) for x, s, y, t in zip(lo_i, shape_i, lo_j, shape_j)):
                return i, j
    return None


def _entry(path: str, section: str, name: str, entry, files: dict, used: dict[str, int], optimizer: bool) -> None:
    where = f"{path}, {'optimizer.' if optimizer else ''}tensors[{show(name)}]"
    obj(entry, where, required=("dtype", "shape", "pieces") + (("like_param",) if optimizer else ()),
        optional=() if optimizer else ("serial_shape",))
    if optimizer and not isinstance(entry["like_param"], bool):
        fail(f"{where}.like_param", f"must be true or false, is {kind(entry['like_param'])}")
    if string(entry["dtype"], f"{where}.dtype") not in DTYPE_NAMES:
        fail(f"{where}.dtype", f"must name a dtype safetensors stores ({', '.join(DTYPE_NAMES)})")
    shape = int_list(entry["shape"], f"{where}.shape")
    if math.prod(s or 1 for s in shape) > MAX_INT:
        fail(f"{where}.shape", f"describes more than {MAX_INT} elements")
    if "serial_shape" in entry and math.prod(int_list(entry["serial_shape"], f"{where}.serial_shape")) != math.prod(shape):
        fail(f"{where}.serial_shape", f"must hold as many elements as the shape {shape} (it is that tensor reshaped). {_REDO}")
    item = nbytes((), DTYPE_NAMES[entry["dtype"]])
    boxes = []
    for i, piece in enumerate(array(entry["pieces"], f"{where}.pieces")):
        at = f"{where}.pieces[{i}]"
        obj(piece, at, required=("file", "key", "offsets", "shape", "bytes", "crc32"))
        file = string(piece["file"], f"{at}.file")
        if file not in files:
            fail(f"{at}.file", f"names a file that the index's 'files' does not list. {_REDO}")
        offsets = int_list(piece["offsets"], f"{at}.offsets")
        box = int_list(piece["shape"], f"{at}.shape")
        if len(offsets) != len(shape) or len(box) != len(shape):
            fail(at, f"offsets and shape must have the tensor's {len(shape)} dims. {_REDO}")
        if any(o + s > g for o, s, g in zip(offsets, box, shape)):
            fail(at, f"lies (partly) outside the tensor's global shape {shape}. {_REDO}")
        if string(piece["key"], f"{at}.key") != f"{section}/{name}@{','.join(map(str, offsets))}":
            fail(f"{at}.key", f"is not the key this piece is saved under ('{section}/<tensor>@<offsets>'). {_REDO}")
        if integer(piece["bytes"], f"{at}.bytes") != math.prod(box) * item:
            fail(f"{at}.bytes", f"must be {math.prod(box) * item} (elements x {item} bytes). {_REDO}")
        integer(piece["crc32"], f"{at}.crc32", hi=2**32 - 1)
        used[file] = used.get(file, 0) + piece["bytes"]
        boxes.append((offsets, box))
    covered = sum(math.prod(b) for _, b in boxes)
    if covered != math.prod(shape):
        fail(f"{where}.pieces", f"cover {covered} of the tensor's {math.prod(shape)} elements. {_REDO}")
    pair = _overlap(boxes)
    if pair is not None:
        fail(f"{where}.pieces", f"pieces {pair[0]} and {pair[1]} overlap. {_REDO}")


def _optimizer(path: str, opt, files: dict, used: dict[str, int]) -> None:
    where = f"{path}, optimizer"
    obj(opt, where, required=("class", "param_groups", "values", "tensors"))
    string(opt["class"], f"{where}.class")
    for g, group in enumerate(array(opt["param_groups"], f"{where}.param_groups")):
        at = f"{where}.param_groups[{g}]"
        obj(group, at, required=("options", "params"))
        for key, value in obj(group["options"], f"{at}.options", optional=None).items():
            _scalar_or_list(value, f"{at}.options[{show(key)}]")
        for i, name in enumerate(array(group["params"], f"{at}.params")):
            string(name, f"{at}.params[{i}]")
    for param, values in obj(opt["values"], f"{where}.values", optional=None).items():
        for key, value in obj(values, f"{where}.values[{show(param)}]", optional=None).items():
            _scalar_or_list(value, f"{where}.values[{show(param)}][{show(key)}]")
    for name, entry in obj(opt["tensors"], f"{where}.tensors", optional=None).items():
        _entry(path, "optimizer", name, entry, files, used, optimizer=True)


def check_index(index, path: str, ckpt_dir: str, format_name: str, version: int) -> dict:
    """``index`` (parsed from ``path``) checked as a checkpoint index of ``ckpt_dir``."""
    obj(index, path, optional=None)
    if index.get("format") != format_name:
        raise CheckpointError(f"{path}: field 'format' is not {format_name!r}; it is not a shardzoo checkpoint index")
    if integer(index.get("version"), f"{path}, version", lo=1, hi=MAX_INT) > version:
        raise CheckpointError(f"{path} is a newer format version than {version}, the newest this shardzoo reads. "
                              f"Upgrade shardzoo")
    obj(index, path, required=("format", "version", "checksum", "files", "tensors"),
        optional=("layout", "config", "config_class", "aliases", "optimizer"))
    if index["checksum"] != "crc32":
        fail(f"{path}, checksum", "must be 'crc32', the only checksum shardzoo writes")
    if index.get("layout") is not None:
        obj(index["layout"], f"{path}, layout", optional=None)
    if index.get("config") is not None:
        obj(index["config"], f"{path}, config", optional=None)
    optional_string(index.get("config_class"), f"{path}, config_class")
    for alias, target in obj(index.get("aliases") or {}, f"{path}, aliases", optional=None).items():
        string(target, f"{path}, aliases[{show(alias)}]")
    files = obj(index["files"], f"{path}, files", optional=None)
    for file, info in files.items():
        resolve_in(ckpt_dir, file, source=f"{path}, files")
        obj(info, f"{path}, files[{show(file)}]", required=("bytes",))
        integer(info["bytes"], f"{path}, files[{show(file)}].bytes")
    used: dict[str, int] = {}
    for name, entry in obj(index["tensors"], f"{path}, tensors", optional=None).items():
        _entry(path, "model", name, entry, files, used, optimizer=False)
    if index.get("optimizer") is not None:
        _optimizer(path, index["optimizer"], files, used)
    for file, total in used.items():
        if total > files[file]["bytes"]:
            fail(f"{path}, files[{show(file)}]", f"holds {files[file]['bytes']} bytes but its pieces need {total}. {_REDO}")
    return index
