"""Request traces for kvtier's simulator: loading, a bundled real slice, and hash synthesis.

A :class:`Trace` is a columnar view of a request log: one row per request with its arrival
time, input and output length, and the ids of its prefix blocks (``block_tokens`` tokens each),
stored CSR-style (``hash_offsets`` into ``hash_ids``). Ids are *prefix-chained*: two requests
share block id ``h`` at position ``j`` only if their first ``j + 1`` blocks are identical, so
"longest cached prefix" is simply "longest run of leading ids present in the cache".

Supported inputs (``load_trace`` detects the format from the name and the first line):

``mooncake``
    JSON lines with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``,
    as published with the Mooncake FAST '25 paper (github.com/kvcache-ai/Mooncake,
    ``FAST25-release/traces``). Plain or gzip-compressed. Every row must satisfy
    ``len(hash_ids) == ceil(input_length / block_tokens)``, and the ids must be prefix-chained:
    an id always at the same position, after the same id.
``azure``
    The Azure LLM inference traces (github.com/Azure/AzurePublicDataset, 2023 and 2024):
    CSV with header ``TIMESTAMP,ContextTokens,GeneratedTokens`` and wall-clock timestamps such
    as ``2023-11-16 18:15:46.6805900``. Times are shifted so the first row is at 0 ms.
``csv``
    A plain CSV with header ``timestamp,input_length,output_length`` (timestamp in ms).

Every format is UTF-8 text, plain or gzip-compressed, with rows in arrival order: timestamps
must be finite and never decrease (ties are fine; the Mooncake traces have many).

The CSV traces carry no content hashes, so :func:`synthesize_hashes` adds them with the
prefix-sharing model below. Its parameters are assumptions, not measurements; they are keyword
arguments of ``load_trace`` so that a user can state their own. A request of a CSV trace may
have at most ``MAX_REQUEST_TOKENS`` (100,000,000) input tokens, ten times the longest context any
model offers: a larger count is a wrong column or a typo, and would make synthesis allocate an id
per block of it.

Prefix-sharing model (deterministic for a given ``seed``)
---------------------------------------------------------
Requests are visited in trace order. For request ``i`` with ``L`` input tokens
(``n = ceil(L / B)`` blocks, ``f = L // B`` of them full):

1. **Follow-up turn.** With probability ``followup_prob`` the request is offered to one of the
   ``session_window`` most recently active sessions, picked uniformly. It becomes that
   session's next turn only if it is longer than the session's last request (a later turn of a
   conversation re-sends the whole earlier context and adds to it). Then its first
   ``prev_L // B`` blocks are the previous turn's full blocks, ids and all; the rest are new.
   The session's last request becomes this one.
2. **New session.** Otherwise the request opens a new session. It starts with one of
   ``num_system_prompts`` shared system prompts of ``system_prompt_tokens`` tokens, drawn with
   Zipf popularity (prompt ``k`` = 1, 2, ... has weight ``k ** -zipf_a``); it shares the
   prompt's first ``min(system_prompt_tokens // B, f)`` blocks with every other request that
   drew the same prompt. The rest of its blocks are new.
3. A partial last block is always new: its hash covers a different token count than any block
   it could match. New ids come from one counter, so ids are dense integers as in Mooncake.

Because an id is only ever reused by copying a whole prefix of an earlier id sequence, equal
ids imply equal prefixes. For reference, in the Mooncake conversation trace every request opens
with the same block and 38.7 % of requests re-use at least two leading blocks of an earlier
request; the default ``followup_prob`` of 0.4 is in that range, the other defaults are guesses.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import itertools
import json
import math
import os
import zlib
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .errors import TraceError

__all__ = [
    "BUNDLED_TRACE_REQUESTS",
    "MAX_REQUEST_TOKENS",
    "Trace",
    "TraceFormat",
    "bundled_trace_path",
    "load_trace",
    "synthesize_hashes",
    "to_lmcache_format",
]

TraceFormat = Literal["mooncake", "azure", "csv"]

#: Mooncake's block size: each hash id covers 512 tokens.
MOONCAKE_BLOCK_TOKENS = 512
#: The bundled slice is the first this-many lines of the Mooncake conversation trace.
BUNDLED_TRACE_REQUESTS = 4000
_BUNDLED_NAME = "mooncake_conversation_head.jsonl.gz"

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_CSV_COLUMNS = ("timestamp", "input_length", "output_length")


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Trace:
    """A request trace in columnar form. Arrays are read-only; ``eq=False`` because arrays
    do not compare to a single bool."""

    timestamps_ms: np.ndarray  # float64 [n], arrival time
    input_lengths: np.ndarray  # int64 [n], prompt tokens
    output_lengths: np.ndarray  # int64 [n], generated tokens
    hash_offsets: np.ndarray  # int64 [n + 1], request i's ids are hash_ids[off[i]:off[i+1]]
    hash_ids: np.ndarray  # uint64 [block_refs], prefix-chained block ids
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    source: str = ""
    format: str = "mooncake"

    def __post_init__(self) -> None:
        n = len(self.timestamps_ms)
        if len(self.input_lengths) != n or len(self.output_lengths) != n:
            raise ValueError("timestamps, input and output lengths must have one entry a request")
        if len(self.hash_offsets) != n + 1:
            raise ValueError(
                f"hash_offsets must have {n + 1} entries, has {len(self.hash_offsets)}"
            )
        if self.hash_offsets[0] != 0 or self.hash_offsets[-1] != len(self.hash_ids):
            raise ValueError("hash_offsets must start at 0 and end at len(hash_ids)")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        for name, dtype in (
            ("timestamps_ms", np.float64),
            ("input_lengths", np.int64),
            ("output_lengths", np.int64),
            ("hash_offsets", np.int64),
            ("hash_ids", np.uint64),
        ):
            # A view, so that making it read-only never changes the caller's array.
            arr = np.ascontiguousarray(getattr(self, name), dtype=dtype).view()
            # frozen: object.__setattr__ is the sanctioned way to normalise fields once.
            object.__setattr__(self, name, _readonly(arr))
        if n and np.any(np.diff(self.hash_offsets) < 0):
            raise ValueError("hash_offsets must be non-decreasing")

    def __len__(self) -> int:
        return self.num_requests

    def __repr__(self) -> str:
        return (
            f"Trace(format={self.format!r}, source={self.source!r}, requests={self.num_requests}, "
            f"block_refs={self.block_refs}, block_tokens={self.block_tokens})"
        )

    @property
    def num_requests(self) -> int:
        return len(self.timestamps_ms)

    @property
    def block_refs(self) -> int:
        return len(self.hash_ids)

    @cached_property
    def distinct_blocks(self) -> int:
        return len(np.unique(self.hash_ids))

    @property
    def duration_s(self) -> float:
        if self.num_requests == 0:
            return 0.0
        return float(self.timestamps_ms[-1] - self.timestamps_ms[0]) / 1000.0

    @property
    def blocks_per_request(self) -> np.ndarray:
        return np.diff(self.hash_offsets)

    def request_hashes(self, i: int) -> np.ndarray:
        """Block ids of request ``i`` (a read-only view)."""
        n = self.num_requests
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"request {i} out of range for a trace of {n}")
        return self.hash_ids[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (all of them if the trace is shorter)."""
        n = max(0, min(n, self.num_requests))
        end = int(self.hash_offsets[n])
        return Trace(
            timestamps_ms=self.timestamps_ms[:n],
            input_lengths=self.input_lengths[:n],
            output_lengths=self.output_lengths[:n],
            hash_offsets=self.hash_offsets[: n + 1],
            hash_ids=self.hash_ids[:end],
            block_tokens=self.block_tokens,
            source=self.source,
            format=self.format,
        )


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


#: Bounds of the columns: lengths are stored as int64, block ids as uint64.
_LENGTH_LIMIT = 2**63
_HASH_ID_LIMIT = 2**64
#: Most input tokens one request of a trace without hashes may have: ten times the longest
#: context window any model offers (10M tokens). Synthesis makes one id per block, so a length
#: that only fits int64 (a typo, a column of bytes) would otherwise ask for terabytes of ids.
MAX_REQUEST_TOKENS = 100_000_000


def _lines(path: Path) -> Generator[tuple[int, str], None, None]:
    """The file's lines, numbered from 1, as text. Gzip is sniffed from the magic bytes rather
    than trusted to the suffix; each line is decoded on its own so that a bad byte names its line.
    A UTF-8 byte-order mark before the first line (spreadsheet programs write one) is skipped.
    """
    with open(path, "rb") as raw:
        is_gzip = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        stream: io.BufferedIOBase = gzip.GzipFile(fileobj=raw) if is_gzip else raw
        lineno = 0
        try:
            for lineno, data in enumerate(stream, start=1):
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(
                        f"{path}: line {lineno}: not UTF-8 text "
                        f"(byte {data[exc.start]:#04x} at position {exc.start})",
                        hint="a trace is UTF-8 text, optionally gzip-compressed: "
                        "check that this is the trace file",
                    ) from None
                if lineno == 1:
                    text = text.removeprefix("\ufeff")
                yield lineno, text
        except (EOFError, gzip.BadGzipFile, zlib.error):
            raise TraceError(
                f"{path}: truncated or corrupt gzip data after line {lineno}",
                hint="the compressed file is cut short or damaged: copy or download it again",
            ) from None


def _no_requests(path: Path, why: str) -> TraceError:
    # Replaying nothing would report "0 requests" and exit 0: a truncated copy or the wrong file.
    return TraceError(
        f"{path}: the trace holds no requests ({why})",
        hint="check that this is the trace file and that it was written completely",
    )


_BLANK = "the file is empty or holds only blank lines"


def _detect_format(path: Path) -> TraceFormat:
    name = path.name.lower()
    name = name.removesuffix(".gz")
    with contextlib.closing(_lines(path)) as lines:
        first = next((text.strip() for _, text in lines if text.strip()), "")
    if not first:
        raise _no_requests(path, _BLANK)
    if first.startswith("{"):
        return "mooncake"
    header = [c.strip() for c in first.split(",")]
    if all(c in header for c in _AZURE_COLUMNS):
        return "azure"
    if all(c in header for c in _CSV_COLUMNS):
        return "csv"
    if name.endswith((".jsonl", ".json")):
        return "mooncake"
    raise TraceError(
        f"{path}: cannot tell the trace format; expected Mooncake JSON lines, an Azure CSV "
        f"({','.join(_AZURE_COLUMNS)}) or a CSV with {','.join(_CSV_COLUMNS)}",
        hint="check the file's first line, or name the format (kvtier simulate --format, "
        "load_trace(format=...))",
    )


def _is_int(x: object) -> bool:
    return type(x) is int  # bool is an int subclass; reject it and floats alike


def _is_count(x: object) -> bool:
    return type(x) is int and 0 <= x < _LENGTH_LIMIT  # bool and float are not counts


def _is_finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _check_arrival_order(path: Path, ts: np.ndarray, linenos: list[int]) -> None:
    # The replay takes requests in file order (so does the hash synthesis, and --limit keeps
    # the first lines); a time that goes backwards means that order is not the arrival order.
    back = np.flatnonzero(np.diff(ts) < 0)
    if len(back):
        k = int(back[0]) + 1
        raise TraceError(
            f"{path}: line {linenos[k]}: timestamp is earlier than the one on line "
            f"{linenos[k - 1]}; requests must be in arrival order",
            hint="sort the rows by timestamp, keeping ties in file order "
            "(for JSON lines: jq -c -s 'sort_by(.timestamp)[]')",
        )


def _check_prefix_chained(
    path: Path, offsets: np.ndarray, ids: np.ndarray, linenos: list[int]
) -> None:
    """Every id must sit at one position after one parent (the id before it; none at position
    0): equal ids are equal prefixes, which the replay's prefix lookup relies on. Vectorised,
    as a real trace holds hundreds of thousands of ids."""
    if not len(ids):
        return
    counts = np.diff(offsets)
    row = np.repeat(np.arange(len(counts)), counts)
    depth = np.arange(len(ids), dtype=np.int64) - offsets[row]
    parent = np.empty_like(ids)
    parent[0] = 0
    parent[1:] = ids[:-1]
    parent[depth == 0] = 0  # depth tells "no parent" apart from a parent of id 0
    # A stable sort keeps each id's uses in file order, so its first use leads its group.
    order = np.argsort(ids, kind="stable")
    s_ids, s_depth, s_parent = ids[order], depth[order], parent[order]
    new_id = s_ids[1:] != s_ids[:-1]
    if not np.any(~new_id & ((s_depth[1:] != s_depth[:-1]) | (s_parent[1:] != s_parent[:-1]))):
        return  # each use agrees with the one before it of the same id
    starts = np.flatnonzero(np.r_[True, new_id])
    first = np.repeat(starts, np.diff(np.r_[starts, len(s_ids)]))
    bad = np.flatnonzero((s_depth != s_depth[first]) | (s_parent != s_parent[first]))
    if not len(bad):
        return
    # The earliest use in the file that disagrees with the id's first use.
    k = int(bad[np.argmin(order[bad])])
    at, seen = int(order[k]), int(order[first[k]])
    h, j, j0 = int(ids[at]), int(depth[at]), int(depth[seen])
    line, line0 = linenos[int(row[at])], linenos[int(row[seen])]
    if j != j0:
        what = f"hash id {h} is block {j} of the request, but block {j0} on line {line0}"
    else:
        what = (
            f"hash id {h} (block {j}) follows id {int(parent[at])}, "
            f"but follows id {int(parent[seen])} on line {line0}"
        )
    raise TraceError(
        f"{path}: line {line}: {what}; hash_ids must be prefix-chained "
        "(an id stands for its whole prefix)",
        hint="each id must always follow the same ids: check that the rows come from one "
        "trace (two traces' ids cannot be mixed) and that hash_ids were not reordered",
    )


def _block_sizes_fitting(n_in: int, count: int) -> tuple[int, int | None] | None:
    """The block sizes ``B`` with ``ceil(n_in / B) == count``, as ``(lowest, highest)`` with
    ``None`` for no upper bound; ``None`` if there are none."""
    if count == 0 or n_in == 0:
        return (1, None) if count == n_in == 0 else None
    lowest = -(-n_in // count)
    highest = -(-n_in // (count - 1)) - 1 if count > 1 else None
    return (lowest, highest) if highest is None or lowest <= highest else None


def _block_count_error(where: str, n_in: int, count: int, block_tokens: int) -> TraceError:
    """A row whose hash_ids do not cover its input in blocks of ``block_tokens`` tokens. Most
    often the trace was hashed with another block size than the one asked for (Mooncake's is
    512 tokens), so the message says which block sizes the row does fit."""
    mismatch = (
        f"{where}: {count} hash_ids for input_length {n_in}, expected "
        f"ceil({n_in}/{block_tokens}) = {-(-n_in // block_tokens)} for {block_tokens}-token blocks"
    )
    fits = _block_sizes_fitting(n_in, count)
    if fits is None:
        return TraceError(f"{mismatch}; no block size fits this row")
    lowest, highest = fits
    if lowest <= MOONCAKE_BLOCK_TOKENS and (highest is None or highest >= MOONCAKE_BLOCK_TOKENS):
        return TraceError(
            f"{mismatch}; the row fits {MOONCAKE_BLOCK_TOKENS}-token blocks, the block size "
            "Mooncake traces are made of",
            hint=f"drop --block-tokens (block_tokens= in load_trace) to use "
            f"{MOONCAKE_BLOCK_TOKENS}, the trace's own block size",
        )
    if highest == lowest:
        sizes = f"{lowest}-token blocks"
    else:
        sizes = f"blocks of {lowest} to {'any number of' if highest is None else highest} tokens"
    return TraceError(
        f"{mismatch}; the row fits {sizes}",
        hint="give the block size the trace's hashes were made with: --block-tokens N "
        "(block_tokens=N in load_trace)",
    )


def _load_mooncake(path: Path, block_tokens: int, limit: int | None) -> Trace:
    ts: list[float] = []
    ins: list[int] = []
    outs: list[int] = []
    counts: list[int] = []
    chunks: list[list[int]] = []
    linenos: list[int] = []
    loads = json.loads
    with contextlib.closing(_lines(path)) as lines:
        for lineno, line in lines:
            if limit is not None and len(ts) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                row = loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: malformed JSON ({exc.msg})") from None
            try:
                t = row["timestamp"]
                n_in = row["input_length"]
                n_out = row["output_length"]
                h = row["hash_ids"]
            except KeyError as exc:
                raise TraceError(f"{where}: missing field {exc.args[0]!r}") from None
            except TypeError:
                raise TraceError(f"{where}: expected a JSON object") from None
            if not (_is_count(n_in) and _is_count(n_out)):
                raise TraceError(
                    f"{where}: input_length/output_length must be integers in [0, 2**63)"
                )
            # json.loads reads NaN and Infinity as floats.
            if type(t) not in (int, float) or not _is_finite(t):
                raise TraceError(f"{where}: timestamp must be a finite number, got {t!r}")
            if type(h) is not list or not all(_is_int(x) and 0 <= x < _HASH_ID_LIMIT for x in h):
                raise TraceError(f"{where}: hash_ids must be a list of integers in [0, 2**64)")
            if len(h) != -(-n_in // block_tokens):
                raise _block_count_error(where, n_in, len(h), block_tokens)
            ts.append(t)
            ins.append(n_in)
            outs.append(n_out)
            counts.append(len(h))
            chunks.append(h)
            linenos.append(lineno)
    if not ts:
        raise _no_requests(path, _BLANK)
    timestamps = np.array(ts, dtype=np.float64)
    _check_arrival_order(path, timestamps, linenos)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(counts, dtype=np.int64, count=len(counts)), out=offsets[1:])
    hash_ids = np.fromiter(
        itertools.chain.from_iterable(chunks), dtype=np.uint64, count=int(offsets[-1])
    )
    _check_prefix_chained(path, offsets, hash_ids, linenos)
    return Trace(
        timestamps_ms=timestamps,
        input_lengths=np.array(ins, dtype=np.int64),
        output_lengths=np.array(outs, dtype=np.int64),
        hash_offsets=offsets,
        hash_ids=hash_ids,
        block_tokens=block_tokens,
        source=str(path),
        format="mooncake",
    )


def _csv_rows(
    path: Path, columns: tuple[str, str, str], limit: int | None
) -> Iterator[tuple[int, list[str]]]:
    with contextlib.closing(_lines(path)) as lines:
        reader = csv.reader(text for _, text in lines)
        try:
            header = next(reader, None)
            if header is None:
                raise _no_requests(path, _BLANK)
            header = [c.strip() for c in header]
            try:
                idx = [header.index(c) for c in columns]
            except ValueError:
                raise TraceError(
                    f"{path}: line 1: header must contain {','.join(columns)}"
                ) from None
            width = max(idx) + 1
            emitted = 0
            for row in reader:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if limit is not None and emitted >= limit:
                    return
                if len(row) < width:
                    raise TraceError(
                        f"{path}: line {reader.line_num}: expected {width} columns, got {len(row)}"
                    )
                emitted += 1
                yield reader.line_num, [row[i].strip() for i in idx]
            if not emitted:
                raise _no_requests(path, "it has a header line but no rows")
        except csv.Error as exc:  # e.g. a NUL byte
            raise TraceError(f"{path}: line {reader.line_num}: {exc}") from None


def _parse_count(s: str, where: str, what: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise TraceError(f"{where}: {what} {s!r} is not an integer") from None
    if not 0 <= v < _LENGTH_LIMIT:
        raise TraceError(f"{where}: {what} must be in [0, 2**63), got {v}")
    return v


def _parse_ms(s: str, where: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise TraceError(f"{where}: timestamp {s!r} is not a number") from None
    if not math.isfinite(v):  # float() reads "nan", "inf" and overflows to inf
        raise TraceError(f"{where}: timestamp must be a finite number, got {s!r}")
    return v


def _datetime_or_nat(s: str) -> np.datetime64:
    try:
        return np.datetime64(s, "ns")
    except (ValueError, OverflowError):
        return np.datetime64("NaT", "ns")


def _azure_ms(path: Path, stamps: list[str], linenos: list[int]) -> np.ndarray:
    """Milliseconds since the first row of Azure's wall-clock TIMESTAMPs."""
    try:
        # numpy parses "2023-11-16 18:15:46.6805900" (100 ns digits) in one vectorised call.
        abs_ns = np.array(stamps, dtype="datetime64[ns]")
    except (ValueError, OverflowError):
        abs_ns = np.array([_datetime_or_nat(s) for s in stamps], dtype="datetime64[ns]")
    bad = np.flatnonzero(np.isnat(abs_ns))  # also what "NaT" and "" parse to
    if len(bad):
        k = int(bad[0])
        raise TraceError(
            f"{path}: line {linenos[k]}: bad TIMESTAMP {stamps[k]!r}",
            hint="Azure trace times look like 2023-11-16 18:15:46.6805900",
        )
    ns = abs_ns.astype(np.int64)
    rel = ns - ns[0] if len(ns) else ns
    return rel.astype(np.float64) / 1e6


def _load_csv_lengths(
    path: Path, fmt: TraceFormat, limit: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    columns = _AZURE_COLUMNS if fmt == "azure" else _CSV_COLUMNS
    stamps: list[str] = []
    ins: list[int] = []
    outs: list[int] = []
    linenos: list[int] = []
    for lineno, (t, n_in, n_out) in _csv_rows(path, columns, limit):
        where = f"{path}: line {lineno}"
        stamps.append(t)
        tokens = _parse_count(n_in, where, columns[1])
        if tokens > MAX_REQUEST_TOKENS:
            raise TraceError(
                f"{where}: {columns[1]} {tokens} is above the limit of "
                f"{MAX_REQUEST_TOKENS:,} input tokens a request",
                hint=f"check that the {columns[1]} column holds token counts; no real prompt "
                f"comes near {MAX_REQUEST_TOKENS:,} tokens",
            )
        ins.append(tokens)
        outs.append(_parse_count(n_out, where, columns[2]))
        linenos.append(lineno)
    if fmt == "azure":
        ts = _azure_ms(path, stamps, linenos)
    else:
        ts = np.array(
            [_parse_ms(s, f"{path}: line {n}") for s, n in zip(stamps, linenos, strict=True)],
            dtype=np.float64,
        )
    _check_arrival_order(path, ts, linenos)
    return ts, np.array(ins, dtype=np.int64), np.array(outs, dtype=np.int64)


def load_trace(
    path: str | os.PathLike[str],
    *,
    format: TraceFormat | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
    seed: int = 0,
    num_system_prompts: int = 8,
    system_prompt_tokens: int = 1024,
    zipf_a: float = 1.0,
    followup_prob: float = 0.4,
    session_window: int = 64,
) -> Trace:
    """Load a request trace.

    ``format`` is detected when not given (see the module docstring). ``limit`` keeps only the
    first that-many requests (at least 1). ``block_tokens`` is the number of tokens per hash id;
    for a Mooncake trace it must be the block size the hashes were made with (512). The
    remaining keyword arguments parametrise the prefix-sharing model used for traces without
    hashes and are ignored for Mooncake traces.

    Raises :class:`kvtier.TraceError` (a ``ValueError``) naming the file, and the line where
    there is one, for a file that is not a trace: a directory, a file with no requests, bytes
    that are not UTF-8, a truncated gzip stream, a malformed or out-of-range value, a timestamp
    that is not finite or earlier than the one before it (requests are replayed in file order,
    which must be the arrival order), Mooncake hash_ids that are not prefix-chained.
    """
    p = Path(path)
    if p.is_dir():
        raise TraceError(
            f"{p} is a directory, not a trace file",
            hint="give the path of a trace file (e.g. one inside that directory)",
        )
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if limit is not None and limit < 1:
        # An empty replay is an error (see _no_requests), so keeping no rows is one too.
        raise ValueError(f"limit must be >= 1 (None: every request), got {limit}")
    fmt = format or _detect_format(p)
    if fmt == "mooncake":
        return _load_mooncake(p, block_tokens, limit)
    if fmt not in ("azure", "csv"):
        raise ValueError(f"unknown trace format {fmt!r}; expected mooncake, azure or csv")
    ts, ins, outs = _load_csv_lengths(p, fmt, limit)
    offsets, ids = synthesize_hashes(
        ins,
        block_tokens=block_tokens,
        seed=seed,
        num_system_prompts=num_system_prompts,
        system_prompt_tokens=system_prompt_tokens,
        zipf_a=zipf_a,
        followup_prob=followup_prob,
        session_window=session_window,
    )
    return Trace(
        timestamps_ms=ts,
        input_lengths=ins,
        output_lengths=outs,
        hash_offsets=offsets,
        hash_ids=ids,
        block_tokens=block_tokens,
        source=str(p),
        format=fmt,
    )


# ---------------------------------------------------------------------------------------------
# Hash synthesis for traces without content hashes
# ---------------------------------------------------------------------------------------------


def synthesize_hashes(
    input_lengths: np.ndarray,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    seed: int = 0,
    num_system_prompts: int = 8,
    system_prompt_tokens: int = 1024,
    zipf_a: float = 1.0,
    followup_prob: float = 0.4,
    session_window: int = 64,
) -> tuple[np.ndarray, np.ndarray]:
    """Prefix-chained block ids for requests of the given input lengths, by the model in the
    module docstring. Returns ``(hash_offsets, hash_ids)``."""
    if not 0.0 <= followup_prob <= 1.0:
        raise ValueError(f"followup_prob must be in [0, 1], got {followup_prob}")
    if num_system_prompts < 0 or system_prompt_tokens < 0 or session_window < 1:
        raise ValueError("num_system_prompts, system_prompt_tokens >= 0 and session_window >= 1")
    lengths = np.asarray(input_lengths, dtype=np.int64)
    if len(lengths) and lengths.min() < 0:
        raise ValueError("input lengths must be >= 0")
    if len(lengths) and lengths.max() > MAX_REQUEST_TOKENS:
        raise ValueError(
            f"input lengths must be at most {MAX_REQUEST_TOKENS:,} tokens, got {lengths.max()}"
        )
    n = len(lengths)
    rng = np.random.default_rng(seed)
    # All random draws up front, in a fixed order, so the result depends only on seed and n.
    offer_followup = (rng.random(n) < followup_prob).tolist()
    pick = rng.random(n).tolist()
    if num_system_prompts > 0:
        w = np.arange(1, num_system_prompts + 1, dtype=np.float64) ** -zipf_a
        prompt_of = rng.choice(num_system_prompts, size=n, p=w / w.sum()).tolist()
    else:
        prompt_of = [-1] * n

    B = block_tokens
    prompt_blocks = system_prompt_tokens // B
    prompts: list[list[int]] = [[] for _ in range(max(num_system_prompts, 0))]
    next_id = 0
    # Each session is [ids of its last request, that request's input length].
    sessions: deque[list[Any]] = deque()
    offsets = np.zeros(n + 1, dtype=np.int64)
    out: list[int] = []

    for i, L in enumerate(lengths.tolist()):
        n_blocks = -(-L // B)
        full = L // B
        shared: list[int] = []
        session: list[Any] | None = None
        j = int(pick[i] * len(sessions))
        if offer_followup[i] and sessions and sessions[j][1] < L:
            session = sessions[j]
            shared = session[0][: session[1] // B]
            del sessions[j]
        if session is None and prompt_of[i] >= 0 and prompt_blocks and full:
            chain = prompts[prompt_of[i]]
            k = min(prompt_blocks, full)
            while len(chain) < k:  # the prompt's ids are minted the first time they are needed
                chain.append(next_id)
                next_id += 1
            shared = chain[:k]
        ids = shared + list(range(next_id, next_id + n_blocks - len(shared)))
        next_id += n_blocks - len(shared)
        if session is None:
            session = [ids, L]
        else:
            session[0], session[1] = ids, L
        sessions.append(session)  # most recently active last
        if len(sessions) > session_window:
            sessions.popleft()
        out.extend(ids)
        offsets[i + 1] = len(out)
    return offsets, np.array(out, dtype=np.uint64)


# ---------------------------------------------------------------------------------------------
# Bundled data and export
# ---------------------------------------------------------------------------------------------


def bundled_trace_path() -> Path:
    """Path of the bundled slice: the first ``BUNDLED_TRACE_REQUESTS`` (4,000) lines of the
    Mooncake conversation trace, gzip-compressed and otherwise unchanged (see data/NOTICE.md)."""
    ref = resources.files("kvtier") / "data" / _BUNDLED_NAME
    # The package is installed as plain files (wheel / editable), so the traversable is a path.
    path = Path(str(ref))
    if not path.is_file():
        raise FileNotFoundError(f"bundled trace missing from the kvtier package: {path}")
    return path


def to_lmcache_format(
    trace: Trace,
    path: str | os.PathLike[str],
    *,
    full_chunks_only: bool = False,
    model_name: str = "kvtier-trace",
) -> Path:
    """Write ``trace`` as an LMCache lookup-hash log (the JSON lines read by
    ``lmcache.tools.cache_simulator``): one event a request with ``timestamp`` (s),
    ``request_id``, ``model_name``, ``chunk_size``, ``seq_len``, ``chunk_hashes`` (hex strings).

    LMCache hashes only complete chunks. By default every block id is written, including a
    request's partial last block, so that LMCache's cache sees the same keys as kvtier's
    replay; ``full_chunks_only=True`` drops the partial block as a live LMCache server would.
    ``shapes``/``dtypes`` are left empty: the caller passes the bytes per chunk explicitly.
    """
    p = Path(path)
    off = trace.hash_offsets.tolist()
    ids = trace.hash_ids.tolist()
    ins = trace.input_lengths.tolist()
    ts = trace.timestamps_ms.tolist()
    B = trace.block_tokens
    dumps = json.dumps
    with open(p, "w", encoding="utf-8") as fh:
        for i in range(trace.num_requests):
            end = off[i + 1]
            if full_chunks_only and ins[i] % B:
                end -= 1
            event = {
                "timestamp": ts[i] / 1000.0,
                "request_id": f"req-{i}",
                "model_name": model_name,
                "chunk_size": B,
                "seq_len": ins[i],
                "dtypes": [],
                "shapes": [],
                "chunk_hashes": [f"{h:#x}" for h in ids[off[i] : end]],
            }
            fh.write(dumps(event))
            fh.write("\n")
    return p
