"""Imports in shardzoo/ only point down the package's layers (docs/design.md, "Package layering").

Every .py file under shardzoo/ is parsed with ast and every import is checked, wherever it
sits (module level or inside a function): ``import a.b``, ``from a import b``, relative
imports (``from . import x``, ``from ..layers import y``) resolved against the file's package,
and ``importlib.import_module`` / ``__import__`` / ``pkgutil.resolve_name`` calls. A dynamic
import must name its module as a string constant: one whose target is computed cannot be
checked, so it is refused too (import the module statically inside the function instead).
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardzoo"

# Bottom to top. A module may import modules of its own unit and of units on lower rows only;
# units on one row are peers and import nothing from each other. A unit is the name after
# "shardzoo." (a subpackage or a top-level module); "shardzoo" is the package's own __init__
# (the public names), which sits above the library and below what is built on its public API.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("comm", "kernels"),
    ("layers",),
    ("checkpoint", "parallel"),
    ("models",),
    ("planner",),
    ("shardzoo",),
    ("testing", "demo_inputs"),
    ("demo",),
    ("cli",),
)
ROW = {unit: row for row, units in enumerate(LAYERS) for unit in units}
RULE = "a module imports only its own unit and units on lower rows (tests/test_layering.py, LAYERS)"
DYNAMIC = {"import_module", "__import__", "resolve_name"}


@dataclass(frozen=True)
class Import:
    line: int
    target: str | None  # dotted module name; None: a dynamic import whose name is not a constant


def module_name(path: pathlib.Path) -> str:
    """shardzoo/comm/mesh.py -> "shardzoo.comm.mesh"; shardzoo/comm/__init__.py -> "shardzoo.comm"."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def unit_of(module: str) -> str:
    """ "shardzoo.comm.mesh" -> "comm"; "shardzoo" -> "shardzoo"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve_relative(name: str, level: int, package: str) -> str:
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _from_targets(node: ast.ImportFrom, package: str) -> list[str]:
    module = _resolve_relative(node.module or "", node.level, package) if node.level else node.module
    # `from shardzoo import comm` imports the subpackage; `from shardzoo import ParallelMesh` the package
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]


def _dynamic_target(node: ast.Call, package: str) -> Import | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in DYNAMIC:
        return None
    arg = node.args[0] if node.args else None
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return Import(node.lineno, None)
    target = arg.value.split(":")[0]  # resolve_name("pkg.mod:attr")
    if target.startswith("."):  # import_module(".x", package): relative to that package, else this file's
        given = node.args[1:2] + [k.value for k in node.keywords if k.arg == "package"]
        if given and isinstance(given[0], ast.Constant) and isinstance(given[0].value, str):
            package = given[0].value
        dots = len(target) - len(target.lstrip("."))
        target = _resolve_relative(target.lstrip("."), dots, package)
    return Import(node.lineno, target)


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import in ``source`` (the text of ``module``), at any depth of the syntax tree."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [Import(node.lineno, t) for t in _from_targets(node, package)]
        elif isinstance(node, ast.Call) and (imp := _dynamic_target(node, package)) is not None:
            found.append(imp)
    return found


def violations(source: str, module: str, where: str, is_package: bool = False) -> list[str]:
    """One line per import of ``module`` that breaks LAYERS (or cannot be checked)."""
    unit = unit_of(module)
    if unit not in ROW:
        return [f"{where}: unit {unit!r} of {module} is on no row of LAYERS; add it where its imports put it"]
    bad = []
    for imp in imports_of(source, module, is_package):
        if imp.target is None:
            bad.append(f"{where}:{imp.line}: a dynamic import with a computed module name cannot be checked; "
                       f"import the module statically (inside the function if it must be lazy)")
            continue
        if imp.target != "shardzoo" and not imp.target.startswith("shardzoo."):
            continue
        other = unit_of(imp.target)
        if other == unit:
            continue
        if other not in ROW:
            bad.append(f"{where}:{imp.line}: {module} imports {imp.target}, whose unit {other!r} is on no row of LAYERS")
        elif ROW[other] >= ROW[unit]:
            bad.append(f"{where}:{imp.line}: {unit} (row {ROW[unit]}) imports {imp.target}, in {other} "
                       f"(row {ROW[other]}): {RULE}")
    return bad


def test_imports_point_down():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        bad += violations(path.read_text(), module_name(path), str(path.relative_to(ROOT)), path.name == "__init__.py")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of its own unit it imports (module level or in a function).

    ``sources``: module -> (its text, whether it is a package's __init__). Importing a submodule
    also runs its package's __init__ first, but that implicit step is no edge: a package's
    __init__ importing its own submodules is the normal layout, not a circle."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        targets = {imp.target for imp in imports_of(source, module, is_package)}
        graph[module] = {t for t in targets if t in sources and t != module and unit_of(t) == unit_of(module)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles (modules in import order, the first repeated at the end) that together name
    every module of every group of modules importing each other, directly or through others
    (strongly connected components, Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found: list[list[str]] = []
    for group in groups:
        named: set[str] = set()
        for start in group:  # a shortest cycle through each module no earlier one named
            if start not in named:
                found.append(_shortest_cycle(graph, start, set(group)))
                named.update(found[-1])
    return found


def _shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """The shortest import path from ``start`` back to itself through ``members``."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(members)}")


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_import_cycle_inside_a_unit():
    found = cycles(import_graph(package_sources()))
    assert not found, ("modules that import each other (directly or through others; imports inside functions "
                       "count):\n" + "\n".join(" -> ".join(c) for c in found) +
                       "\nmove what both need into a lower module of the unit, or pass it in")


def test_cycle_check_sees_hidden_imports():
    sources = {
        "shardzoo.models.a": ("from shardzoo.models.b import f\n", False),
        "shardzoo.models.b": ("def f():\n    from .c import g\n", False),
        "shardzoo.models.c": ("import importlib\nimportlib.import_module('shardzoo.models.a')\n", False),
        "shardzoo.models": ("from shardzoo.models.a import X\n", True),
        "shardzoo.models.d": ("from shardzoo.models.c import g\nfrom shardzoo.comm import ops\n", False),
    }
    assert cycles(import_graph(sources)) == [["shardzoo.models.a", "shardzoo.models.b", "shardzoo.models.c",
                                              "shardzoo.models.a"]]
    sources["shardzoo.models.d"] = ("from shardzoo.models import X\n", False)  # the package's __init__ itself
    sources["shardzoo.models.a"] = ("from shardzoo.models.d import y\n", False)
    assert cycles(import_graph(sources)) == [["shardzoo.models", "shardzoo.models.a", "shardzoo.models.d",
                                              "shardzoo.models"]]


def test_every_unit_has_a_row():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(ROW), f"units on no row of LAYERS: {sorted(units - set(ROW))}"
    assert len(ROW) == sum(len(row) for row in LAYERS), "a unit is on two rows"


SYNTHETIC = """
import torch
from shardzoo.comm import collectives
from shardzoo import kernels
import shardzoo.layers.placements

def f(name):
    from ..models import gpt2
    from . import mesh
    import importlib
    importlib.import_module("shardzoo.checkpoint")
    __import__("shardzoo.comm.ops")
    importlib.import_module(name)
"""


def test_checker_catches_upward_imports():
    found = violations(SYNTHETIC, "shardzoo.comm.fake", "fake.py")
    lines = sorted(int(v.split(":")[1]) for v in found)
    # kernels is a peer (4), layers (5), models via a relative import in a function (8),
    # checkpoint by importlib string (11), the computed name (13); collectives, mesh and ops are comm's own
    assert lines == [4, 5, 8, 11, 13], found
    assert any("comm (row 0) imports shardzoo.models.gpt2, in models (row 3)" in v for v in found)


@pytest.mark.parametrize("source, module, is_package, target", [
    ("from . import placements", "shardzoo.layers", True, "shardzoo.layers.placements"),
    ("from .. import comm", "shardzoo.layers.linear_1d", False, "shardzoo.comm"),
    ("from ..comm.mesh import ParallelMesh", "shardzoo.layers.linear_1d", False, "shardzoo.comm.mesh"),
    ("from shardzoo import ParallelMesh", "shardzoo.demo", False, "shardzoo"),
    ("import importlib\nimportlib.import_module('.gpt2', 'shardzoo.models')", "shardzoo.models.spec", False,
     "shardzoo.models.gpt2"),
])
def test_resolution(source, module, is_package, target):
    assert imports_of(source, module, is_package)[-1].target == target


def test_lower_imports_pass():
    source = "from shardzoo.comm import ops\nfrom ..layers import placements\n"
    assert violations(source, "shardzoo.models.x", "x.py") == []
