"""The import graph of a Python package, read from its source (``ast``, nothing imported), and
the circles in it.

A module's imports are the ``import`` and ``from ... import`` statements that run: those at
module level (inside ``if``/``try``/``with`` and class bodies too) and, with ``deferred=True``,
those inside functions. Imports under ``if TYPE_CHECKING:`` never run and are left out unless
``type_checking=True`` asks for the graph the type checker follows. An
import names the deepest module of the package it reaches: ``from . import cuda`` the submodule
``cuda`` when there is one, else the package; ``from .base import X`` the module ``base``. A
parent package that Python runs first on the way (its ``__init__``) is not an edge: only what a
module names.

    python tests/import_graph.py python/kvtier    # circles: top-level, all, all + type-only

tests/test_import_graph.py and tests/test_architecture.py use :func:`import_cycles`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` (a folder with ``__init__.py``) by dotted name,
    the package's own name first (``kvtier``, ``kvtier.codecs``, ``kvtier.codecs.base`` ...)."""
    root = Path(root)
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    # extension modules (``_core.abi3.so``, or only its stub): modules that import nothing here
    for path in sorted([*root.rglob("*.so"), *root.rglob("*.pyd"), *root.rglob("*.pyi")]):
        parts = list(path.relative_to(root.parent).parts)
        parts[-1] = parts[-1].split(".")[0]
        found.setdefault(".".join(parts), path)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, deferred: bool, type_checking: bool
) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` that run (see the module's docstring)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
                stack.extend(child.orelse)  # the else branch runs
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                if deferred:
                    stack.append(child)
            else:
                stack.append(child)


def import_graph(
    root: Path, *, deferred: bool = True, type_checking: bool = False
) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``deferred``: imports inside functions too;
    ``type_checking``: those under ``if TYPE_CHECKING:`` too)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree, deferred, type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # ``from pkg import sub`` imports the submodule where there is one
                targets = [
                    f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:  # ``import a.b.c``: its deepest module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    out.append(sorted(members))
    return out


def import_cycles(
    root: Path, *, deferred: bool = True, type_checking: bool = False
) -> list[list[str]]:
    """The import circles of the package at ``root``: each a group of modules that import one
    another in a circle (a strongly connected component of :func:`import_graph` of two or more
    modules), sorted; empty when there is none."""
    graph = import_graph(root, deferred=deferred, type_checking=type_checking)
    return sorted(c for c in _components(graph) if len(c) > 1)


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """A shortest circle of imports from ``start`` back to it (``[start, ..., start]``), or
    ``[]`` when there is none: an example to print for a component."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return []


def report(root: Path) -> str:
    lines = []
    for deferred, type_checking, title in (
        (False, False, "top-level imports"),
        (True, False, "all imports that run (deferred too)"),
        (True, True, "all imports and type-only ones (under TYPE_CHECKING)"),
    ):
        graph = import_graph(root, deferred=deferred, type_checking=type_checking)
        cycles = import_cycles(root, deferred=deferred, type_checking=type_checking)
        lines.append(f"{title}: {len(cycles)} circle(s)")
        for members in cycles:
            lines.append(f"  {len(members)} modules: {', '.join(members)}")
            lines.append(f"    e.g. {' -> '.join(shortest_cycle(graph, members[0]))}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else "python/kvtier")))
