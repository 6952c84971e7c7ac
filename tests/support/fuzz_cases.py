"""Hypothesis strategies that damage real saved files: byte edits, truncation, extension,
header length fields near 2**64, replaced or edited safetensors headers, and JSON documents
(index.json, config.json, model.safetensors.index.json) edited at a random place.

For the checkpoint fuzz tests (imports hypothesis)."""

from __future__ import annotations

import json
import struct

from hypothesis import strategies as st

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=12), st.sampled_from(["", "..", "/etc/passwd", "../x", "F32", "I32", "float32"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=8)
HUGE = st.sampled_from([2**31, 2**32 + 1, 2**40, 2**62, 2**62 + 1, 2**63, 2**64 - 1, 2**64, -1, -2**63])


def split(raw: bytes) -> tuple[int, dict, bytes]:
    """(header length, parsed header, data) of a safetensors file."""
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header, data: bytes, pad: bool = True) -> bytes:
    """A safetensors file from a header (a dict, or its JSON bytes) and data; ``pad``
    pads the header with spaces to a multiple of 8 bytes. The inverse of ``split``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def damaged_bytes(draw, raw: bytes) -> bytes:
    """``raw`` with a few bytes changed, cut short, extended, or its length field replaced."""
    kind = draw(st.sampled_from(["edit", "truncate", "extend", "length"]))
    if kind == "edit":
        out = bytearray(raw)
        for at, value in draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=6)):
            out[at] = value
        return bytes(out)
    if kind == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if kind == "extend":
        return raw + draw(st.binary(min_size=1, max_size=64))
    n = struct.unpack("<Q", raw[:8])[0]
    length = draw(st.one_of(st.integers(2**64 - 2**16, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(max(0, n - 16), n + 16)))
    return struct.pack("<Q", length) + raw[8:]


@st.composite
def damaged_header(draw, raw: bytes) -> bytes:
    """``raw`` (a safetensors file) with its header replaced by non-JSON or wrong-typed JSON, or
    one entry's dtype / shape / data_offsets edited (the data kept)."""
    n, header, data = split(raw)
    kind = draw(st.sampled_from(["bytes", "json", "entry", "entry", "entry"]))
    if kind == "bytes":
        return join(draw(st.binary(max_size=64)), data, pad=draw(st.booleans()))
    if kind == "json":
        return join(json.dumps(draw(JSON_VALUES)).encode(), data)
    key = draw(st.sampled_from(sorted(header)))
    entry = header[key]
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "drop", "extra", "whole"]))
    if field == "dtype":
        entry = {**entry, "dtype": draw(st.sampled_from(["F32", "I32", "F16", "BF16", "F64", "U8", "BOOL", "F4", "Q4", "f32", ""]))}
    elif field == "shape":
        entry = {**entry, "shape": draw(st.lists(st.one_of(st.integers(-2, 20), HUGE), max_size=4))}
    elif field == "data_offsets":
        a, b = entry.get("data_offsets", [0, 0]) if isinstance(entry, dict) else (0, 0)
        entry = {**entry, "data_offsets": draw(st.one_of(
            st.lists(st.one_of(st.integers(-8, len(data) + 8), HUGE), max_size=3),
            st.just([b, a]), st.just([a, b + 4]), st.just([max(0, a - 4), b - 4]), st.just([a, a]), st.just([a + 4, b + 4])))}
    elif field == "drop" and isinstance(entry, dict) and entry:
        entry = {k: v for k, v in entry.items() if k != draw(st.sampled_from(sorted(entry)))}
    elif field == "extra":
        entry = {**entry, draw(st.text(max_size=6)): draw(JSON_VALUES)}
    else:
        entry = draw(JSON_VALUES)
    return join({**header, key: entry}, data)


def _paths(doc, prefix=()):
    """Every path (tuple of keys / indices) into a JSON document, the root included."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def damaged_json(draw, doc):
    """A copy of JSON document ``doc`` with one change at a random place: a value replaced (by
    any JSON value, a huge number, a list or an object), a key dropped, renamed or added, a list
    item dropped or repeated, two list items swapped."""
    doc = json.loads(json.dumps(doc))
    path = draw(st.sampled_from(list(_paths(doc))))
    op = draw(st.sampled_from(["replace", "huge", "drop", "rename", "add", "repeat", "swap"]))
    if not path:
        return draw(JSON_VALUES) if op == "replace" else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "replace":
        parent[last] = draw(JSON_VALUES)
    elif op == "huge":
        parent[last] = draw(st.one_of(HUGE, st.lists(HUGE, min_size=1, max_size=3)))
    elif op == "drop":
        del parent[last]
    elif op == "rename" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = parent.pop(last)
    elif op == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    elif op == "repeat" and isinstance(parent, list):
        parent.insert(last, parent[last])
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = draw(st.integers(0, len(parent) - 1))
        parent[last], parent[other] = parent[other], parent[last]
    else:
        parent[last] = draw(JSON_VALUES)
    return doc
