"""Reading JSON from disk as untrusted input: parse errors and every field's type and range
become a :class:`CheckpointError` that names the file, the field and the rule.

Messages name what was expected and the JSON type that was found, never the value itself
(the file may not be what its name says). ``where`` strings read like
``"ckpt/index.json, tensors['fc1.weight'].shape[1]"``.
"""

from __future__ import annotations

import json
from typing import Any

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.paths import show

MAX_INT = 2**62  # bound of every size, offset and count read from disk (no real tensor comes near)
_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true / false", int: "an integer",
          float: "a number", type(None): "null"}


def kind(value) -> str:
    """The JSON type of ``value`` in words ("an array", "a string", ...)."""
    return _NAMES.get(type(value), type(value).__name__)


class _Refused(ValueError):
    """A construct Python's json accepts but JSON does not (or that makes a file ambiguous)."""


def _refuse_constant(name: str):
    raise _Refused(f"{name} is not a JSON value")


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Refused("an object repeats a key")
        out[key] = value
    return out


def parse_json(raw: bytes, where: str):
    """``raw`` parsed as strict JSON (no NaN / Infinity, no repeated keys); ``where`` names the source."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where} is not UTF-8 text, so not JSON; the file is corrupted or is not what its "
                              f"name says") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        problem = f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        problem = "nested too deeply"
    except _Refused as e:
        problem = str(e)
    except ValueError:  # Python's limit on the digits of an integer
        problem = "a number too long to read"
    raise CheckpointError(f"{where} is not valid JSON ({problem}); the file is corrupted or is not what its "
                          f"name says")


def load_json_file(path: str, what: str = "") -> Any:
    """The JSON value in file ``path`` (read errors become CheckpointError too)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    return parse_json(raw, f"{path}{what}")


def fail(where: str, rule: str):
    raise CheckpointError(f"{where}: {rule}")


def obj(value, where: str, required: tuple[str, ...] = (), optional: tuple[str, ...] | None = ()) -> dict:
    """``value`` as a JSON object with string keys, the ``required`` keys present and (unless
    ``optional`` is None) no keys besides ``required`` and ``optional``."""
    if not isinstance(value, dict):
        fail(where, f"must be an object, is {kind(value)}")
    missing = [k for k in required if k not in value]
    if missing:
        fail(where, f"lacks the field(s) {', '.join(missing)}")
    if optional is not None:
        extra = [k for k in value if k not in required and k not in optional]
        if extra:
            fail(where, f"has {len(extra)} unknown field(s) (e.g. {show(extra[0])}); it was written by another "
                        f"program or edited")
    return value


def string(value, where: str) -> str:
    if not isinstance(value, str):
        fail(where, f"must be a string, is {kind(value)}")
    return value


def optional_string(value, where: str) -> str | None:
    return None if value is None else string(value, where)


def integer(value, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """An integer (not a boolean) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(where, f"must be an integer, is {kind(value)}")
    if not lo <= value <= hi:
        fail(where, f"must be between {lo} and {hi}")
    return value


def array(value, where: str, max_len: int | None = None) -> list:
    if not isinstance(value, list):
        fail(where, f"must be an array, is {kind(value)}")
    if max_len is not None and len(value) > max_len:
        fail(where, f"has {len(value)} items; at most {max_len} are allowed")
    return value


def int_list(value, where: str, max_len: int = 64) -> list[int]:
    """An array of at most ``max_len`` integers in ``[0, MAX_INT]`` (a shape or offsets)."""
    return [integer(v, f"{where}[{i}]") for i, v in enumerate(array(value, where, max_len))]
