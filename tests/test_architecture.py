"""The package map of docs/architecture.md is the code's: every unit (a package, or a module at
the top of ``kvtier`` or ``kvtier.integrations``) has a floor there, no import reaches up a
floor, no import circle exists (deferred imports count), and no code outside a unit touches a
``_`` name only that unit defines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from import_graph import import_cycles, import_graph, module_names

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "python" / "kvtier"
MAP = REPO / "docs" / "architecture.md"
#: the bottom floor's private modules: any unit may import them (their public names)
BOTTOM = ("kvtier._core", "kvtier._torch", "kvtier._cuda", "kvtier._arrays")
#: packages that group units rather than being one
GROUPS = ("kvtier", "kvtier.integrations")


def floors() -> dict[str, int]:
    """Unit -> floor, from the rows ``| N | `unit` | ... |`` of the map."""
    rows = re.findall(r"^\| (\d+) \| `([\w.]+)` \|", MAP.read_text(), re.M)
    assert rows, f"{MAP}: no floor table"
    return {unit: int(floor) for floor, unit in rows}


def unit_of(module: str, packages: set[str]) -> str:
    package = module if module in packages else module.rpartition(".")[0]
    while package not in GROUPS and package.rpartition(".")[0] not in GROUPS:
        package = package.rpartition(".")[0]  # a subpackage belongs to its unit
    return module if package in GROUPS else package


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return module_names(PACKAGE)


@pytest.fixture(scope="module")
def units(modules: dict[str, Path]) -> dict[str, str]:
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    return {m: unit_of(m, packages) for m in modules}


def test_every_unit_is_on_the_map_and_no_import_reaches_up_a_floor(units: dict[str, str]) -> None:
    floor = floors()
    missing = sorted(set(units.values()) - set(floor))
    assert not missing, f"units missing from {MAP.name}'s table: {missing}"
    stale = sorted(set(floor) - set(units.values()))
    assert not stale, f"{MAP.name} lists units that do not exist: {stale}"
    upward = [
        f"{a} (floor {floor[units[a]]}) imports {b} (floor {floor[units[b]]})"
        for a, targets in import_graph(PACKAGE).items()
        for b in targets
        if floor[units[b]] > floor[units[a]]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle() -> None:
    assert import_cycles(PACKAGE) == []


def _private_definitions(tree: ast.AST) -> set[str]:
    """The ``_`` names a module defines: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Name):
                    names.add(leaf.id)
                elif isinstance(leaf, ast.Attribute):
                    names.add(leaf.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _own(receiver: ast.expr) -> bool:
    """``self``, ``cls``, ``super()`` or ``type(x)``: a class reaching into itself."""
    if isinstance(receiver, ast.Name):
        return receiver.id in ("self", "cls")
    return (
        isinstance(receiver, ast.Call)
        and isinstance(receiver.func, ast.Name)
        and receiver.func.id in ("super", "type")
    )


def test_no_code_touches_another_units_private_names(
    modules: dict[str, Path], units: dict[str, str]
) -> None:
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items() if p.suffix == ".py"}
    defined: dict[str, set[str]] = {}
    for module, tree in trees.items():
        defined.setdefault(units[module], set()).update(_private_definitions(tree))
    reaches = []
    for module, tree in trees.items():
        mine = defined[units[module]]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    name = alias.name
                    private = name.startswith("_") and not name.startswith("__")
                    if private and name not in mine and f"kvtier.{name}" not in BOTTOM:
                        reaches.append(f"{module}:{node.lineno} imports {name}")
            elif isinstance(node, ast.Attribute) and not _own(node.value):
                name = node.attr
                if name.startswith("_") and not name.startswith("__") and name not in mine:
                    owners = [u for u, names in defined.items() if name in names]
                    if owners:
                        reaches.append(f"{module}:{node.lineno} touches {name} of {owners}")
    assert not reaches, "\n".join(reaches)


def test_the_checks_see_a_reach_and_an_upward_import(tmp_path: Path) -> None:
    """The rules on a small package: a subpackage is one unit, a top-level module is its own."""
    root = tmp_path / "kvtier"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("from .inner import _hidden\n")
    (root / "low" / "inner.py").write_text("def _hidden():\n    pass\n")
    (root / "top.py").write_text("from . import low\n\ndef f(x):\n    return x._hidden\n")
    modules = module_names(root)
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    assert unit_of("kvtier.low.inner", packages) == "kvtier.low"
    assert unit_of("kvtier.top", packages) == "kvtier.top"
    defined = _private_definitions(ast.parse((root / "low" / "inner.py").read_text()))
    assert defined == {"_hidden"}
    assert import_graph(root)["kvtier.top"] == {"kvtier.low"}
