"""tests/import_graph.py finds import circles, deferred ones too, and kvtier's attention and codec
modules import one another in none."""

from __future__ import annotations

from pathlib import Path

from import_graph import import_cycles, import_graph

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "kvtier"


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_deferred_import_closes_a_circle_and_a_type_checking_one_does_not(
    tmp_path: Path,
) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import x\n",
            "b.py": "def f():\n    from . import a\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
            "sub/__init__.py": "from ..c import y\n",
        },
    )
    assert import_graph(pkg, deferred=False)["pkg.a"] == {"pkg.b"}
    assert import_graph(pkg)["pkg.b"] == {"pkg.a"}
    assert import_graph(pkg)["pkg.c"] == set()
    assert import_graph(pkg)["pkg.sub"] == {"pkg.c"}
    assert import_cycles(pkg, deferred=False) == []
    assert import_cycles(pkg) == [["pkg.a", "pkg.b"]]
    assert import_graph(pkg, type_checking=True)["pkg.c"] == {"pkg.a"}


def test_the_attention_and_codec_modules_import_in_no_circle() -> None:
    """Not even through a type-only import."""
    mine = ("kvtier.attend", "kvtier.codecs", "kvtier._torch", "kvtier._cuda")
    for cycle in import_cycles(PACKAGE, type_checking=True):
        assert not [m for m in cycle if m.startswith(mine)], cycle
