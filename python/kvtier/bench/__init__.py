"""Benchmarks behind ``kvtier bench``: each prints figures beside a named baseline measured in the
same run, and never passes or fails on time."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from ..cli import CommandParser, main
from ..results import add_save_option


def bench_parser(
    suite: str, doc: str | None, quick: str, json: str = "print one JSON object, no table"
) -> argparse.ArgumentParser:
    """The arguments every ``kvtier bench SUITE`` takes: ``--json``, ``--quick`` (a smoke run of
    ``quick``'s size) and ``--save PATH`` (its main ends with ``kvtier.results.save_if_asked``).
    A bad option is the CLI's ``error:``/``hint:`` pair and exit status 2, as everywhere in
    ``kvtier``."""
    ap = CommandParser(
        prog=f"kvtier bench {suite}", description=doc.splitlines()[0] if doc else None
    )
    ap.add_argument("--json", action="store_true", help=json)
    ap.add_argument("--quick", action="store_true", help=f"{quick} (a smoke run)")
    add_save_option(ap)
    return ap


def run_as_script(suite: str) -> NoReturn:
    """``python -m kvtier.bench.SUITE ARGS``: ``kvtier bench SUITE ARGS``, whose parser turns a bad
    option into ``error:``/``hint:`` lines rather than a traceback."""
    raise SystemExit(main(["bench", suite, *sys.argv[1:]]))
