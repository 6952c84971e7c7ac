"""The margin report: how much of its bound each parallel-vs-serial comparison used.

Every assert of ``shardzoo.testing.asserts`` calls :func:`record` with the largest fraction of
its bound (``testing.dtypes.reorder_bound``) that any element used. When the environment variable
``SHARDZOO_MARGINS`` names a directory, each process (the pytest process and every pool worker,
which inherit the variable) appends its records to ``<dir>/<pid>.jsonl``; :func:`tightest` reads
them back. ``pytest --margins`` sets the variable, prints the 20 tightest comparisons at the end
and fails the run if any used more than half of its bound (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable

ENV = "SHARDZOO_MARGINS"
LIMIT = 0.5  # a comparison that uses more than this fraction of its bound passes by luck
_label = {"test": None, "paused": False}


def test_id() -> str:
    """The test this process is running: the label a pool call carries, else pytest's own."""
    if _label["test"]:
        return _label["test"]
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]


def labelled(test: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` with its records labelled ``test`` (a pool worker does not see the
    parent's PYTEST_CURRENT_TEST)."""
    _label["test"] = test
    try:
        return fn(*args)
    finally:
        _label["test"] = None


@contextlib.contextmanager
def paused():
    """Record nothing inside: for comparisons a test expects to fail (a fault it injects)."""
    _label["paused"] = True
    try:
        yield
    finally:
        _label["paused"] = False


def record(what: str, used: float, dtype: Any) -> None:
    """Note that comparison ``what`` used ``used`` of its bound (a no-op unless enabled)."""
    folder = os.environ.get(ENV)
    if not folder or _label["paused"]:
        return
    line = json.dumps({"test": test_id(), "what": what, "used": float(used), "dtype": str(dtype)})
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(line + "\n")


def tightest(folder: str, top: int = 20) -> tuple[list[dict], int]:
    """The ``top`` comparisons of ``folder`` using the most of their bound (most first; one row
    per test, tensor name and dtype) and the number of records read."""
    rows: dict[tuple, dict] = {}  # every rank records the same comparison: keep each one's largest
    count = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        count += 1
                        key = (r["test"], r["what"], r["dtype"])
                        if key not in rows or r["used"] > rows[key]["used"]:
                            rows[key] = r
    return sorted(rows.values(), key=lambda r: -r["used"])[:top], count


def format_rows(rows: list[dict]) -> list[str]:
    """One line per record: fraction used, dtype, test id and tensor name."""
    return [f"{r['used']:7.3f}  {r['dtype']:<14} {r['test']}  [{r['what']}]" for r in rows]
