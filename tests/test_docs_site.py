"""The docs site's own files: ``docs/results/index.md`` lists the result folders as they are
(``make docs`` checks it too, and fails on it; this says so sooner)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_results_index_lists_every_results_folder() -> None:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", DOCS / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    index = DOCS / "results" / "index.md"
    assert index.read_text(encoding="utf-8") == hooks.results_index(), (
        f"docs/results/index.md does not list the folders of docs/results/ as they are: "
        f"regenerate it with {hooks.REGENERATE}"
    )
