"""Trace files that are not traces, each with the error it must give (file name, line, reason).

Shared by the loader tests (the Python API raises ``TraceError``) and the CLI tests (one
``error:`` line and one ``hint:`` line, exit 2). Each writer makes a small real file.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

from kvtier.traces import bundled_trace_path

CSV_HEADER = "timestamp,input_length,output_length\n"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _row(t: object = 0, input_length: int = 600, output_length: int = 5, ids: object = None) -> str:
    ids = [0, 1] if ids is None else ids
    # json.dumps writes float("nan") as NaN, as a careless producer would.
    return json.dumps(
        {
            "timestamp": t,
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": ids,
        }
    )


def _bytes(name: str, data: bytes) -> Callable[[Path], Path]:
    def write(tmp: Path) -> Path:
        path = tmp / name
        path.write_bytes(data)
        return path

    return write


def _text(name: str, text: str) -> Callable[[Path], Path]:
    return _bytes(name, text.encode())


def _truncated_gzip(tmp: Path) -> Path:
    path = tmp / "cut.jsonl.gz"  # what `head -c 1000 trace.jsonl.gz` leaves
    path.write_bytes(bundled_trace_path().read_bytes()[:1000])
    return path


def _directory(tmp: Path) -> Path:
    path = tmp / "traces"
    path.mkdir()
    return path


#: name -> (writer, regex the error message must match after the file name)
BAD_TRACES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated gzip": (_truncated_gzip, r"truncated or corrupt gzip"),
    "hash id >= 2**64": (
        _text("big.jsonl", f"{_row()}\n{_row(ids=[0, 2**64])}\n"),
        r"line 2: hash_ids .*2\*\*64",
    ),
    "output_length >= 2**63": (
        _text("long.jsonl", _row(output_length=2**63) + "\n"),
        r"line 1: input_length/output_length",
    ),
    "csv length >= 2**63": (
        _text("big.csv", CSV_HEADER + "0,512,1\n1,99999999999999999999,1\n"),
        r"line 3: input_length must be in \[0, 2\*\*63\)",
    ),
    # A wrong column or a typo: it fits int64, but hash synthesis would need an id per block.
    "csv length over the request limit": (
        _text("huge.csv", CSV_HEADER + "0,512,1\n1,1000000000,1\n"),
        r"line 3: input_length 1000000000 is above the limit of 100,000,000 input tokens",
    ),
    "not UTF-8": (
        _bytes("latin1.csv", CSV_HEADER.encode() + b"0,512,1\n1,\xff512,1\n"),
        r"line 3: not UTF-8",
    ),
    "not UTF-8 inside gzip": (
        _bytes("latin1.jsonl.gz", gzip.compress(_row().encode() + b"\n\xff\n")),
        r"line 2: not UTF-8",
    ),
    "NaN timestamp": (
        _text("nan.jsonl", f"{_row(0)}\n{_row(float('nan'))}\n"),
        r"line 2: timestamp must be a finite number",
    ),
    "infinite csv timestamp": (
        _text("inf.csv", CSV_HEADER + "1e400,512,1\n"),
        r"line 2: timestamp must be a finite number",
    ),
    "NaT azure timestamp": (
        _text("nat.csv", AZURE_HEADER + "2023-11-16 18:15:46.6805900,10,1\nNaT,10,1\n"),
        r"line 3: bad TIMESTAMP 'NaT'",
    ),
    "unsorted timestamps": (
        _text("unsorted.jsonl", f"{_row(5)}\n{_row(5)}\n{_row(3)}\n"),
        r"line 3: timestamp is earlier than the one on line 2",
    ),
    "unsorted azure timestamps": (
        _text(
            "unsorted_azure.csv",
            AZURE_HEADER + "2023-11-16 18:15:50.0,10,1\n2023-11-16 18:15:46.0,10,1\n",
        ),
        r"line 3: timestamp is earlier than the one on line 2",
    ),
    "directory": (_directory, r"is a directory"),
    "empty file": (_bytes("empty.jsonl", b""), r"the trace holds no requests \(the file is empty"),
    "empty csv": (_bytes("empty.csv", b""), r"the trace holds no requests"),
    "only blank lines inside gzip": (
        _bytes("blank.jsonl.gz", gzip.compress(b"\n  \n\n")),
        r"the trace holds no requests \(the file is empty or holds only blank lines\)",
    ),
    "csv header without rows": (
        _text("header.csv", CSV_HEADER + "\n"),
        r"the trace holds no requests \(it has a header line but no rows\)",
    ),
    # Prefix-chained ids: an id stands for its whole prefix, so it has one position and parent.
    "hash id at two positions": (
        _text("depth.jsonl", f"{_row(ids=[0, 1])}\n{_row(input_length=300, ids=[1])}\n"),
        r"line 2: hash id 1 is block 0 of the request, but block 1 on line 1",
    ),
    "hash id repeated in a row": (
        _text("repeat.jsonl", f"{_row(ids=[0, 1])}\n{_row(ids=[2, 2])}\n"),
        r"line 2: hash id 2 is block 1 of the request, but block 0 on line 2",
    ),
    "hash id after two parents": (
        # What two traces with their own id counters give when concatenated.
        _text(
            "parents.jsonl",
            f"{_row(ids=[0, 1])}\n\n{_row(ids=[2, 3])}\n{_row(ids=[2, 1])}\n",
        ),
        r"line 4: hash id 1 \(block 1\) follows id 2, but follows id 0 on line 1; "
        r"hash_ids must be prefix-chained",
    ),
}
