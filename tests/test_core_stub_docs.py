"""The docstrings of the hand-written stub ``python/kvtier/_core.pyi`` are the Rust doc comments
the built extension carries: the docs site's API reference reads the stub (static analysis, no
build), so a doc comment changed in ``crates/kvtier-py`` must be copied into the stub."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kvtier import _core

STUB = Path(_core.__file__).with_name("_core.pyi")
#: The stub's parts with a page in the reference (docs/reference/).
DOCUMENTED = ("Core", "Plan", "StoreStats", "prefix_hashes")
#: What a PyO3 object inherits when its Rust code has no doc comment.
INHERITED = {
    inspect.cleandoc(doc or "")
    for doc in (object.__new__.__doc__, list.__doc__, int.__doc__, len.__doc__)
} | {"Return len(self)."}


def _runtime_doc(obj: object) -> str | None:
    doc = inspect.cleandoc(getattr(obj, "__doc__", None) or "")
    return doc if doc and doc not in INHERITED else None


def _stub_docs() -> dict[str, str | None]:
    """Dotted name -> the stub's docstring, for each documented definition and its members."""
    docs: dict[str, str | None] = {}
    for node in ast.parse(STUB.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.ClassDef | ast.FunctionDef) or node.name not in DOCUMENTED:
            continue
        docs[node.name] = ast.get_docstring(node)
        for member in node.body if isinstance(node, ast.ClassDef) else []:
            name = f"{node.name}.{member.name}" if isinstance(member, ast.FunctionDef) else None
            if name is not None and name not in docs:  # a property's getter, not its setter
                docs[name] = ast.get_docstring(member)
    return docs


@pytest.mark.parametrize(("name", "stub_doc"), sorted(_stub_docs().items()))
def test_stub_docstring_is_the_rust_doc_comment(name: str, stub_doc: str | None) -> None:
    owner, _, member = name.partition(".")
    obj = getattr(_core, owner)
    runtime = _runtime_doc(vars(obj).get(member) if member else obj)
    if runtime is None:
        return  # no doc comment in Rust: the stub may say what it likes (or nothing)
    assert stub_doc == runtime, (
        f"python/kvtier/_core.pyi: the docstring of {name} is not the doc comment of the built "
        f"extension; copy it into the stub:\n{runtime}"
    )


def test_every_documented_part_of_the_stub_is_found() -> None:
    names = _stub_docs()
    assert set(DOCUMENTED) <= set(names)
    assert "Core.plan" in names and "Plan.summary" in names
