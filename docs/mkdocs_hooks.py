"""mkdocs hooks for the docs site (mkdocs.yml loads this file), and the writer of
``docs/results/index.md``.

That page lists the folders under ``docs/results/`` that have a README, each by its README's
title. It is a file in the repository, so that links to it work on GitHub as on the site:
``python docs/mkdocs_hooks.py`` writes it, and the site's build fails (a warning, under
``--strict``) while it lists other folders than those there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
#: The command that writes ``docs/results/index.md``, from the repository's root.
REGENERATE = "python docs/mkdocs_hooks.py"

log = logging.getLogger("mkdocs.plugins.kvtier")


def results_index(results: Path = RESULTS) -> str:
    """The page: one line per folder of ``results`` with a README.md, titled by its heading."""
    lines = [
        f"<!-- Written by `{REGENERATE}` from the folders' READMEs: run it after adding one. -->",
        "",
        "# Results",
        "",
        "Each folder holds the files that one benchmark or simulation wrote, with a README that",
        "says which command wrote them, on which machine and code, and what they show. The guides",
        "quote these figures; `tests/test_docs_figures.py` checks the quoted ones against the files.",
        "",
    ]
    for readme in sorted(results.glob("*/README.md")):
        first = readme.read_text(encoding="utf-8").partition("\n")[0]
        title = first.removeprefix("# ").strip() or readme.parent.name
        lines.append(f"- [{readme.parent.name}]({readme.parent.name}/README.md): {title}")
    return "\n".join(lines) + "\n"


def on_pre_build(config: Any, **kwargs: Any) -> None:
    index = Path(config["docs_dir"]) / "results" / "index.md"
    if not index.is_file() or index.read_text(encoding="utf-8") != results_index(index.parent):
        log.warning(
            "docs/results/index.md does not list the folders of docs/results/ as they are: "
            "regenerate it with %s",
            REGENERATE,
        )


if __name__ == "__main__":
    (RESULTS / "index.md").write_text(results_index(), encoding="utf-8")
