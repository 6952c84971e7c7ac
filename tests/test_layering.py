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


def test_every_unit_has_a_row():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(ROW), f"units on no row of LAYERS: {sorted(units - set(ROW))}"
    assert len(ROW) == sum(len(row) for row in LAYERS), "a unit is on two rows"


SYNTHETIC = """
import torch
from shardzoo.comm import collectives
from shardzoo import kernels
import shardzoo.layers.layouts

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
    ("from . import layouts", "shardzoo.layers", True, "shardzoo.layers.layouts"),
    ("from .. import comm", "shardzoo.layers.linear_1d", False, "shardzoo.comm"),
    ("from ..comm.mesh import ParallelMesh", "shardzoo.layers.linear_1d", False, "shardzoo.comm.mesh"),
    ("from shardzoo import ParallelMesh", "shardzoo.demo", False, "shardzoo"),
    ("import importlib\nimportlib.import_module('.gpt2', 'shardzoo.models')", "shardzoo.models.families", False,
     "shardzoo.models.gpt2"),
])
def test_resolution(source, module, is_package, target):
    assert imports_of(source, module, is_package)[-1].target == target


def test_lower_imports_pass():
    assert violations("from shardzoo.comm import ops\nfrom ..layers import layouts\n", "shardzoo.models.x", "x.py") == []
