"""A griffe extension for the docs site (mkdocs.yml loads it): kvtier's docstrings are prose in
reST, which mkdocstrings renders as Markdown. This rewrites the three reST forms they use that
Markdown lacks, before any docstring is parsed:

- a role (``:class:`BlockManager```, ``:meth:`~kvtier.Core.plan```, ``:func:`.config.x```)
  becomes the name in code, linked to its entry in the API reference where it has one (an
  optional cross-reference: a name with no entry stays plain code, never a broken link). Names
  resolve as Sphinx resolves them: in the docstring's scope, then as a suffix of a unique path;
- a paragraph ending in ``::`` ends in ``:`` (its indented block is a code block either way);
- a doctest (``>>>`` lines) becomes a fenced Python block.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|data|attr|exc|obj|const):`([^`]+)`")
_TITLED = re.compile(r"(?s)(.*?)\s*<([^<>]+)>")


def _objects(obj: griffe.Object) -> Iterator[griffe.Object | griffe.Alias]:
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            yield member
        else:
            yield from _objects(member)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        objects = list(_objects(pkg))
        # every path in the package -> the path of the object it stands for (through aliases)
        targets = {o.path: o.target_path if o.is_alias else o.path for o in objects}
        paths = {path: _final(path, targets) for path in targets}
        for obj in objects:
            if not obj.is_alias and obj.docstring is not None:
                obj.docstring.value = _markdown(obj.docstring.value, obj, paths)


def _final(path: str, targets: dict[str, str]) -> str:
    seen = {path}
    while targets.get(path, path) not in seen:
        path = targets[path]
        seen.add(path)
    return path


def _markdown(text: str, obj: griffe.Object, paths: dict[str, str]) -> str:
    text = _ROLE.sub(lambda m: _role(m[1], m[2], obj, paths), text)
    text = re.sub(r"(?m)^[ \t]*::[ \t]*$", "", text)
    text = re.sub(r"(?m)(\S)[ \t]*::[ \t]*$", r"\1:", text)
    return _fence_doctests(text)


def _role(role: str, target: str, obj: griffe.Object, paths: dict[str, str]) -> str:
    title = None
    if titled := _TITLED.fullmatch(target):
        title, target = titled[1], titled[2]
    short = target.startswith("~")
    target = target.lstrip("~!")
    name = target.lstrip(".")
    shown = title or (name.rpartition(".")[2] if short else name)
    if role in ("meth", "func") and title is None:
        shown += "()"
    path = _resolve(name, relative=target.startswith("."), obj=obj, paths=paths)
    if path is None:
        return f"`{shown}`"
    return f'<autoref identifier="{path}" optional><code>{html.escape(shown)}</code></autoref>'


def _resolve(name: str, *, relative: bool, obj: griffe.Object, paths: dict[str, str]) -> str | None:
    """The path ``name`` stands for as Sphinx finds it: a full path, a name in the scope of
    ``obj`` or of a parent, else the only path ending in ``.name``."""
    if not relative and name in paths:
        return paths[name]
    scope: griffe.Object | None = obj
    head, _, rest = name.partition(".")
    while scope is not None:
        if f"{scope.path}.{name}" in paths:
            return paths[f"{scope.path}.{name}"]
        try:
            found = scope.resolve(head)
        except (griffe.NameResolutionError, griffe.AliasResolutionError):
            found = None
        if found is not None and not relative:
            found = paths.get(found, found)
            full = f"{found}.{rest}" if rest else found
            return paths.get(full, full)
        scope = scope.parent
    ends = {path for p, path in paths.items() if p.endswith(f".{name}")}
    return ends.pop() if len(ends) == 1 else None


def _fence_doctests(text: str) -> str:
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith(">>>") and not fenced:
            if out and out[-1].strip():
                out.append("")
            out.append("```python")
            fenced = True
        elif fenced and not line.strip():
            out.append("```")
            fenced = False
        out.append(line)
    if fenced:
        out.append("```")
    return "\n".join(out)
