from __future__ import annotations

import gzip
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from bad_traces import BAD_TRACES

from kvtier.errors import TraceError
from kvtier.traces import (
    BUNDLED_TRACE_REQUESTS,
    MAX_REQUEST_TOKENS,
    Trace,
    bundled_trace_path,
    load_trace,
    synthesize_hashes,
)

_ARRAYS = ("timestamps_ms", "input_lengths", "output_lengths", "hash_offsets", "hash_ids")


def _shared_data() -> Path:
    env = os.environ.get("KVTIER_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


FULL_TRACE = _shared_data() / "traces" / "mooncake_conversation.jsonl"
needs_full_trace = pytest.mark.skipif(
    not FULL_TRACE.is_file(),
    reason=f"real Mooncake trace not found at {FULL_TRACE} (set KVTIER_SHARED_DATA)",
)


@pytest.fixture(scope="module")
def full_trace() -> Trace:
    return load_trace(FULL_TRACE)


def _assert_prefix_chained(trace: Trace) -> None:
    """Equal id => equal whole prefix up to and including it."""
    seen: dict[int, tuple[int, ...]] = {}
    for i in range(trace.num_requests):
        ids = trace.request_hashes(i).tolist()
        for j, h in enumerate(ids):
            prefix = tuple(ids[: j + 1])
            assert seen.setdefault(h, prefix) == prefix, f"id {h} has two prefixes"


def _assert_block_counts(trace: Trace) -> None:
    expected = -(-trace.input_lengths // trace.block_tokens)
    assert np.array_equal(trace.blocks_per_request, expected)


@needs_full_trace
def test_full_mooncake_trace_matches_data_readme(full_trace: Trace) -> None:
    assert full_trace.format == "mooncake"
    assert full_trace.block_tokens == 512
    assert full_trace.num_requests == 12_031
    assert full_trace.block_refs == 288_500
    assert full_trace.distinct_blocks == 182_790
    assert 58 * 60 < full_trace.duration_s < 60 * 60  # "~59 min"
    assert full_trace.hash_ids.dtype == np.uint64
    assert full_trace.hash_offsets.dtype == np.int64
    _assert_block_counts(full_trace)


@needs_full_trace
def test_bundled_slice_is_head_of_real_trace(full_trace: Trace) -> None:
    bundled = load_trace(bundled_trace_path())
    assert bundled.num_requests == BUNDLED_TRACE_REQUESTS
    head = full_trace.head(BUNDLED_TRACE_REQUESTS)
    for name in _ARRAYS:
        assert np.array_equal(getattr(bundled, name), getattr(head, name)), name


def test_bundled_slice_loads() -> None:
    path = bundled_trace_path()
    assert path.name.endswith(".jsonl.gz")
    assert path.stat().st_size < 1_000_000
    assert (path.parent / "NOTICE.md").is_file()
    trace = load_trace(path)
    assert trace.num_requests == BUNDLED_TRACE_REQUESTS
    assert trace.request_hashes(0)[0] == 0
    _assert_block_counts(trace)


def test_trace_accessors() -> None:
    trace = load_trace(bundled_trace_path())
    head = trace.head(3)
    assert head.num_requests == len(head) == 3
    assert head.block_refs == int(trace.hash_offsets[3])
    assert np.array_equal(head.request_hashes(2), trace.request_hashes(2))
    assert np.array_equal(trace.request_hashes(-1), trace.hash_ids[trace.hash_offsets[-2] :])
    assert trace.duration_s == (trace.timestamps_ms[-1] - trace.timestamps_ms[0]) / 1000
    with pytest.raises(IndexError):
        trace.request_hashes(trace.num_requests)
    with pytest.raises(ValueError, match="read-only"):
        trace.hash_ids[0] = 1
    assert trace.head(10**9).num_requests == trace.num_requests
    assert trace.head(0).block_refs == 0


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}


def test_gzip_and_plain_load_the_same(tmp_path: Path) -> None:
    rows = [GOOD, {"timestamp": 7, "input_length": 512, "output_length": 1, "hash_ids": [0]}]
    plain = _write_jsonl(tmp_path / "t.jsonl", rows)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_trace(plain), load_trace(gz)
    for name in _ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert a.num_requests == 2 and a.block_refs == 3 and a.distinct_blocks == 2


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"timestamp": 1, "input_length": 10', "malformed JSON"),
        ({"timestamp": 1, "input_length": 10, "output_length": 1}, "missing field 'hash_ids'"),
        (
            {"timestamp": 1, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]},
            "expected",
        ),
        ({"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}, "hash_ids"),
        ({"timestamp": 1, "input_length": -1, "output_length": 1, "hash_ids": []}, "input_length"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_line_names_the_line(tmp_path: Path, bad: object, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(ValueError, match=rf"line 3\b.*{message}"):
        load_trace(path)


AZURE_ROWS = [
    # Azure LLM inference trace format (AzurePublicDataset): wall-clock time with 100 ns digits.
    ("2023-11-16 18:15:46.6805900", 374, 44),
    ("2023-11-16 18:15:50.9951690", 396, 109),
    ("2023-11-16 18:15:51.0004020", 879, 21),
    ("2023-11-16 18:15:53.2145800", 1548, 231),
    ("2023-11-16 18:15:53.5611230", 2113, 12),
    ("2023-11-16 18:15:54.2000000", 4096, 77),
    ("2023-11-16 18:15:55.0100000", 130, 5),
    ("2023-11-16 18:15:56.0000000", 5000, 300),
    ("2023-11-16 18:15:57.5000000", 6100, 90),
    ("2023-11-16 18:15:58.7500000", 1024, 31),
    ("2023-11-16 18:16:00.0000000", 7300, 64),
    ("2023-11-16 18:16:01.0000000", 9000, 12),
]


def _write_azure(path: Path) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{t},{c},{g}" for t, c, g in AZURE_ROWS]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_azure_csv_is_loaded_with_synthesized_prefix_chained_hashes(tmp_path: Path) -> None:
    path = _write_azure(tmp_path / "AzureLLMInferenceTrace_conv.csv")
    trace = load_trace(path, seed=3)
    assert trace.format == "azure"
    assert trace.num_requests == len(AZURE_ROWS)
    assert trace.input_lengths.tolist() == [c for _, c, _ in AZURE_ROWS]
    assert trace.output_lengths.tolist() == [g for _, _, g in AZURE_ROWS]
    assert trace.timestamps_ms[0] == 0.0
    assert trace.timestamps_ms[1] == pytest.approx(4314.579)
    assert trace.duration_s == pytest.approx(14.31941)
    _assert_block_counts(trace)
    _assert_prefix_chained(trace)

    again = load_trace(path, seed=3)
    for name in _ARRAYS:
        assert np.array_equal(getattr(trace, name), getattr(again, name))


def test_synthesis_is_deterministic_and_shares_prefixes() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20_000, size=2_000)
    a = synthesize_hashes(lengths, seed=11)
    b = synthesize_hashes(lengths, seed=11)
    c = synthesize_hashes(lengths, seed=12)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])
    trace = Trace(
        timestamps_ms=np.arange(len(lengths), dtype=np.float64),
        input_lengths=lengths,
        output_lengths=np.zeros(len(lengths), dtype=np.int64),
        hash_offsets=a[0],
        hash_ids=a[1],
        format="csv",
    )
    _assert_block_counts(trace)
    _assert_prefix_chained(trace)
    assert trace.distinct_blocks < trace.block_refs  # some sharing happened
    assert int(trace.hash_ids.max()) == trace.distinct_blocks - 1  # dense ids, like Mooncake


def test_synthesis_model_parameters() -> None:
    lengths = np.array([1100, 2000, 3000, 4000])
    # No system prompts, no follow-ups: nothing is shared.
    off, ids = synthesize_hashes(lengths, num_system_prompts=0, followup_prob=0.0)
    assert len(np.unique(ids)) == len(ids) == sum(math.ceil(x / 512) for x in lengths)
    # One system prompt of two blocks, no follow-ups: every request opens with the same 2 ids.
    off, ids = synthesize_hashes(
        lengths, num_system_prompts=1, system_prompt_tokens=1024, followup_prob=0.0
    )
    firsts = {tuple(ids[off[i] : off[i] + 2].tolist()) for i in range(len(lengths))}
    assert len(firsts) == 1
    # Always a follow-up of the only (growing) session: each turn extends the previous one.
    off, ids = synthesize_hashes(lengths, num_system_prompts=0, followup_prob=1.0, session_window=1)
    for i in range(1, len(lengths)):
        prev_full = int(lengths[i - 1]) // 512
        assert (
            ids[off[i] : off[i] + prev_full].tolist()
            == ids[off[i - 1] : off[i - 1] + prev_full].tolist()
        )
        assert ids[off[i] + prev_full] not in set(ids[: off[i]].tolist())


def test_plain_csv_and_format_detection(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,input_length,output_length\n0,512,1\n250.5,1536,2\n")
    trace = load_trace(path, block_tokens=256)
    assert trace.format == "csv"
    assert trace.timestamps_ms.tolist() == [0.0, 250.5]
    assert trace.blocks_per_request.tolist() == [2, 6]
    _assert_prefix_chained(trace)

    weird = tmp_path / "trace.txt"
    weird.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="cannot tell the trace format"):
        load_trace(weird)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12x,3\n")
    with pytest.raises(ValueError, match=r"line 2.*ContextTokens"):
        load_trace(bad)


_LENGTHS_CSV = "timestamp,input_length,output_length\n0,512,1\n250,1536,2\n"
#: One small trace of each format, by file name (the suffix does not decide the format).
_TRACE_TEXTS = {
    "lengths.csv": _LENGTHS_CSV,
    "lengths.txt": _LENGTHS_CSV,
    "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    + "".join(f"{t},{c},{g}\n" for t, c, g in AZURE_ROWS),
    "mooncake.jsonl": json.dumps(GOOD) + "\n",
    "mooncake.txt": json.dumps(GOOD) + "\n",
    "mooncake.jsonl.gz": json.dumps(GOOD) + "\n",
}


@pytest.mark.parametrize("name", list(_TRACE_TEXTS))
def test_a_utf8_byte_order_mark_is_read_past(tmp_path: Path, name: str) -> None:
    """Spreadsheet programs (Excel's "CSV UTF-8") and some editors start a file with a UTF-8
    byte-order mark: the trace loads, by the format its first line says, as it does without."""
    plain, marked = tmp_path / ("plain-" + name), tmp_path / ("bom-" + name)
    data = _TRACE_TEXTS[name].encode("utf-8")
    compress = gzip.compress if name.endswith(".gz") else bytes
    plain.write_bytes(compress(data))
    marked.write_bytes(compress(b"\xef\xbb\xbf" + data))
    a, b = load_trace(plain), load_trace(marked)
    assert b.format == a.format
    for array in _ARRAYS:
        assert np.array_equal(getattr(a, array), getattr(b, array)), array


@pytest.mark.parametrize("case", list(BAD_TRACES))
def test_a_bad_trace_file_raises_trace_error_naming_file_and_line(
    tmp_path: Path, case: str
) -> None:
    write, message = BAD_TRACES[case]
    path = write(tmp_path)
    with pytest.raises(TraceError, match=re.escape(str(path)) + r".*" + message) as info:
        load_trace(path)
    assert isinstance(info.value, ValueError)  # what callers caught before TraceError existed
    assert info.value.hint


def test_equal_timestamps_are_in_arrival_order(tmp_path: Path) -> None:
    path = tmp_path / "ties.csv"
    path.write_text("timestamp,input_length,output_length\n0,512,1\n7,512,1\n7,512,1\n")
    trace = load_trace(path)
    assert trace.timestamps_ms.tolist() == [0.0, 7.0, 7.0]
    assert trace.duration_s == 0.007


def test_a_csv_request_may_have_up_to_max_request_tokens(tmp_path: Path) -> None:
    path = tmp_path / "long.csv"
    path.write_text(f"timestamp,input_length,output_length\n0,{MAX_REQUEST_TOKENS},1\n")
    assert load_trace(path).blocks_per_request.tolist() == [-(-MAX_REQUEST_TOKENS // 512)]
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        f"2023-11-16 18:15:46.6805900,{MAX_REQUEST_TOKENS + 1},3\n"
    )
    with pytest.raises(
        TraceError, match=rf"azure.csv: line 2: ContextTokens {MAX_REQUEST_TOKENS + 1}"
    ):
        load_trace(azure)
    with pytest.raises(ValueError, match="at most 100,000,000 tokens"):
        synthesize_hashes(np.array([MAX_REQUEST_TOKENS + 1]))


@pytest.mark.parametrize("block_tokens", [256, 1024])
def test_mooncake_hashes_read_with_another_block_size_say_they_are_512_token_blocks(
    block_tokens: int,
) -> None:
    with pytest.raises(TraceError) as info:
        load_trace(bundled_trace_path(), block_tokens=block_tokens)
    message = str(info.value)
    assert (
        f"line 1: 14 hash_ids for input_length 6758, expected ceil(6758/{block_tokens})" in message
    )
    assert "the row fits 512-token blocks, the block size Mooncake traces are made of" in message
    assert info.value.hint is not None and "drop --block-tokens" in info.value.hint


def test_a_row_hashed_with_another_block_size_says_which_sizes_it_fits(tmp_path: Path) -> None:
    # 5 ids for 5000 tokens: blocks of 1000 to 1249 tokens, not Mooncake's 512.
    path = _write_jsonl(
        tmp_path / "k.jsonl", [{**GOOD, "input_length": 5000, "hash_ids": [0, 1, 2, 3, 4]}]
    )
    with pytest.raises(TraceError, match=r"line 1: .*; the row fits blocks of 1000 to 1249 tokens"):
        load_trace(path)
    corrupt = _write_jsonl(
        tmp_path / "c.jsonl", [{**GOOD, "input_length": 2, "hash_ids": [0, 1, 2]}]
    )
    with pytest.raises(TraceError, match=r"line 1: .*; no block size fits this row"):
        load_trace(corrupt)


@pytest.mark.parametrize("limit", [0, -1])
def test_limit_must_keep_at_least_one_request(limit: int) -> None:
    with pytest.raises(
        ValueError, match=rf"limit must be >= 1 \(None: every request\), got {limit}"
    ):
        load_trace(bundled_trace_path(), limit=limit)


def _first_unchained_line(rows: list[list[int]]) -> int | None:
    """The line of the first id whose whole prefix differs from the one it had first, found
    one id at a time: the reference for the loader's vectorised check."""
    seen: dict[int, tuple[int, ...]] = {}
    for line, ids in enumerate(rows, start=1):
        for j, h in enumerate(ids):
            if seen.setdefault(h, tuple(ids[: j + 1])) != tuple(ids[: j + 1]):
                return line
    return None


def test_the_prefix_chain_check_agrees_with_a_per_id_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 8 * 512, size=200)
    off, ids = synthesize_hashes(lengths, seed=5)
    chained = [ids[off[i] : off[i + 1]].tolist() for i in range(len(lengths))]
    broken = 0
    for case in range(40):
        rows = [list(r) for r in chained]
        i = int(rng.integers(len(rows)))
        j = int(rng.integers(len(rows[i])))
        # Odd cases reuse an id from elsewhere, even ones bring a new id (which breaks only the
        # chain of the id after it, if that id is used again).
        rows[i][j] = int(rng.choice(ids)) if case % 2 else int(ids.max()) + 1
        path = _write_jsonl(
            tmp_path / f"m{case}.jsonl",
            [
                {"timestamp": 0, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}
                for r in rows
            ],
        )
        expected = _first_unchained_line(rows)
        if expected is None:
            assert load_trace(path).block_refs == len(ids)
        else:
            broken += 1
            with pytest.raises(TraceError, match=rf": line {expected}: hash id "):
                load_trace(path)
    assert broken >= 10
    # The same trace unbroken loads, and so does a row that reuses a prefix of another.
    rows = [*chained, chained[0][:1]]
    path = _write_jsonl(
        tmp_path / "ok.jsonl",
        [
            {"timestamp": 0, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}
            for r in rows
        ],
    )
    assert load_trace(path).num_requests == len(rows)
