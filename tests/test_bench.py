"""The benchmarks run end to end and compare like with like."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest


def _bench(*args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return json.loads(out)


def test_bench_core_quick_prints_figures_beside_baselines() -> None:
    result = _bench("core", "--quick", "--no-lmcache")
    assert result["stats"]["rust_updates_per_s"] > 0 and result["stats"]["python_updates_per_s"] > 0
    assert result["plan"]["moves"] == result["plan"]["python_moves"], "same work on both sides"
    sim = result["simulate"]
    assert sim["kvtier_lru"]["block_hit_rate"] == sim["python_lru"]["block_hit_rate"]
    model = sim["python_model"]
    assert model["requests"] == 200 and model["wall_s"] > 0 and model["kvtier_wall_s"] > 0
    assert model["block_hit_rate"] == model["kvtier_block_hit_rate"], "same work on both sides"


def test_bench_codecs_quick_prints_figures_beside_baselines() -> None:
    result = _bench("codecs", "--quick", "--no-quanto")
    rows = {r["name"]: r for r in result["cpu"]}
    for name in ("int8 encode", "int8 decode", "int4 encode", "int4 decode"):
        assert rows[name]["gb_per_s"] > 0
        assert rows[name]["backend"] == "torch"
    for name in ("int8 encode", "int8 decode", "int4 encode", "int4 decode"):
        native = rows[f"{name} (native)"]
        assert native["backend"] == "native" and native["kv_gb_per_s"] > 0
        assert native["speedup_vs_torch_cpu"] == pytest.approx(rows[name]["us"] / native["us"])
    assert rows["torch copy (memory pace)"]["kv_gb_per_s"] > 0
    transcode = rows["int8->int4 transcode (native)"]
    assert transcode["torch_cpu_us"] == rows["int8->int4 transcode (torch)"]["us"]
    assert rows["plain torch int8 encode"]["us"] > 0, "the named baseline is measured in the run"
    # bytes moved: the fp16 input plus exactly the packed rows the codec writes
    fp16 = result["fp16_bytes"]
    assert rows["int4 encode"]["bytes_moved"] == fp16 + fp16 * 11 // 32


def test_bench_attend_quick_prints_figures_beside_baselines() -> None:
    result = _bench("attend", "--quick")
    assert result["backend"] in ("cpu", "reference") and result["device"] == "cpu"
    rows = {r["mix"]: r for r in result["rows"]}
    assert set(rows) == {"level0", "int8", "int4", "ladder"}
    for r in rows.values():
        assert r["us"] > 0 and r["gb_per_s"] > 0
        assert r["copy_gb_per_s"] > 0 and r["sdpa_us"] > 0, "the baselines are measured in the run"
    # the pool bytes a call reads: fp32 K/V as SDPA's cache, int8/int4 less
    assert rows["level0"]["pool_bytes"] == rows["level0"]["sdpa_cache_bytes"]
    assert rows["int4"]["pool_bytes"] < rows["ladder"]["pool_bytes"] < rows["int8"]["pool_bytes"]


def test_bench_manager_quick_prints_figures_beside_baselines() -> None:
    result = _bench("manager", "--quick", "--threads", "1")
    assert result["fp16_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    cpu = next(d for d in result["devices"] if d["device"] == "cpu")
    decode = cpu["decode"]
    assert decode["baseline"]["tokens_per_s"] > 0, "the named baseline is measured in the run"
    work = result["workload"]
    assert decode["baseline"]["attention"]["count"] == work["steps"] * 32
    fastest = 0.0
    for name, dtype in (("baseline", "fp16"), ("baseline_bf16", "bf16"), ("baseline_fp32", "fp32")):
        assert decode[name]["setting"] == f"contiguous torch cache, {dtype}"
        assert decode[name]["tokens"] == decode["baseline"]["tokens"], "same work at every dtype"
        fastest = max(fastest, decode[name]["decode_tokens_per_s"])
    # the manager's decode rate against the strongest contiguous cache, whichever dtype it is
    best = decode["default"]["decode_tokens_per_s"] / fastest
    assert decode["default"]["decode_tokens_per_s_ratio_vs_fastest_baseline"] == best
    for name, read in (
        ("default", "attend"),
        ("fp16_only", "attend"),
        ("default_gather", "gather"),
    ):
        r = decode[name]
        assert r["read"] == read
        assert r["tokens"] == decode["baseline"]["tokens"], "same work on both sides"
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_ratio_vs_baseline"] > 0
        assert r["attention"]["count"] == work["steps"] * 32, "attention per layer per step"
        assert r["append"]["count"] == work["sequences"] * work["steps"] * 32
        assert r["step"]["count"] == work["steps"]
        assert r["step"]["max_ms"] >= r["step"]["mean_ms"] >= 0
        assert r["memory"]["tokens"] == work["sequences"] * (work["prompt"] + work["steps"])
    memory = cpu["memory"]
    assert memory["default"]["ladder"] == ["fp16", "int8", "int4"]
    assert memory["fp16_only"]["ladder"] == ["fp16"]
    # real bytes: fp16 only holds exactly fp16 K/V (whole blocks); compression holds less
    assert memory["fp16_only"]["ratio_vs_fp16"] >= 1.0
    assert memory["default"]["ratio_vs_fp16"] < 1.0
    assert memory["aggressive"]["ratio_vs_fp16"] < memory["default"]["ratio_vs_fp16"]
    assert decode["default"]["memory"]["ratio_vs_fp16"] < 1.0
    # attend reads the pools' bytes, measured beside a plain copy of as many bytes
    for name in ("default", "fp16_only"):
        b = decode[name]["bandwidth"]
        assert b["bytes"] == decode[name]["memory"]["held_bytes"]
        assert b["attend_gb_per_s"] > 0 and b["copy_gb_per_s"] > 0
        overhead = decode[name]["attend_overhead"]  # the call beside its kernel alone
        assert overhead["call_us"] > 0 and overhead["kernel_us"] > 0
    assert decode["default"]["bandwidth"]["bytes"] < decode["fp16_only"]["bandwidth"]["bytes"]
    for m in memory.values():
        assert m["pool_bytes"] >= m["held_bytes"] > 0


def test_bench_stores_quick_prints_figures_beside_baselines() -> None:
    result = _bench("stores", "--quick")
    kinds = {"host", "disk"}
    if shutil.which("redis-server") and importlib.util.find_spec("redis"):
        kinds.add("redis")
        assert result["environment"]["redis"]["version"]
    else:
        assert result["skipped"]["redis"], "a skipped store says why"
    assert set(result["baselines"]) == kinds, "each store is measured beside its plain baseline"
    cells = {(r["store"], r["op"], r["size"], r["batch"]) for r in result["rows"]}
    assert len(cells) == len(result["rows"]) == len(kinds) * 2 * len(result["sizes"]) * 2
    assert {r["store"] for r in result["rows"]} == kinds
    for r in result["rows"]:
        assert r["gb_per_s"] > 0 and r["values_per_s"] > 0 and r["baseline_gb_per_s"] > 0
        assert r["bytes"] == r["values"] * r["size"] and r["values"] % r["batch"] == 0
        # the checksum's own share beside the stores that checksum; none beside the host store
        assert (r["checksum_pct"] is None) == (r["store"] == "host")
        assert r["checksum_pct"] is None or r["checksum_pct"] > 0
    assert result["evictions"] == dict.fromkeys(kinds, 0), "the budgets hold every value"


@pytest.mark.redis
def test_bench_share_quick_prints_figures_beside_baselines() -> None:
    result = _bench("share", "--quick")
    assert result["blocks"] == result["prompt_tokens"] // 16
    assert result["bytes"] == result["blocks"] * 2 * 32 * 8 * 16 * 128 * 2
    take, publish = result["take"], result["publish"]
    assert take["baseline_ms"] > 0, "the named baseline is measured in the run"
    assert take["add_sequence_ms"] > 0 and take["ratio_vs_baseline"] > 0
    assert publish["step_ms"] > 0 and publish["step_ms_without_sharing"] >= 0
    assert result["append_prompt_ms"] > 0 and result["redis"]["version"]


# `kvtier bench vllm` drives real vLLM engines (minutes even with --quick on a CPU), so its run is
# left to the benchmark; its workload and its command line are tested here.


def _trace(requests: list[list[int]]) -> Any:
    import numpy as np

    from kvtier.traces import Trace

    n = len(requests)
    return Trace(
        timestamps_ms=np.arange(n, dtype=np.float64),
        input_lengths=np.array([512 * len(r) for r in requests]),
        output_lengths=np.ones(n, dtype=np.int64),
        hash_offsets=np.cumsum([0] + [len(r) for r in requests]),
        hash_ids=np.array([h for r in requests for h in r], dtype=np.uint64),
    )


def test_bench_vllm_conversations_follow_shared_prefixes_beyond_the_first_block() -> None:
    from kvtier.bench.vllm import conversations

    trace = _trace([[0, 1, 2], [0, 5], [0, 1, 2, 3], [0, 5, 6], [0, 7], [0, 1, 2, 3, 4]])
    # Every request shares block 0 (the system prompt): that alone makes no conversation.
    assert conversations(trace) == {0: [0, 2, 5], 1: [1, 3], 4: [4]}
    assert conversations(trace, min_shared=1) == {0: [0, 1, 2, 3, 4, 5]}


def test_bench_vllm_scales_trace_blocks_to_a_few_tokens() -> None:
    from kvtier.bench.vllm import scaled_length

    assert scaled_length(512 * 4, 4, 16) == 64
    assert scaled_length(512 * 3 + 256, 4, 16) == 56  # the partial last block in proportion
    assert scaled_length(512 * 3 + 1, 4, 16) == 49  # ... and at least one token


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("quick", [False, True])
def test_bench_vllm_workload_keeps_the_bundled_traces_conversations(quick: bool) -> None:
    from kvtier.bench.vllm import (
        BLOCK,
        FULL,
        MIN_SHARED,
        QUICK,
        build_workload,
        corpus_tokens_used,
        distinct_blocks,
        max_model_len,
        scaled_length,
    )
    from kvtier.traces import bundled_trace_path, load_trace

    s = QUICK if quick else FULL
    per = s.tokens_per_trace_block
    trace = load_trace(bundled_trace_path())
    corpus = list(range(1, 100_001))  # every token differs: equal tokens mean the same block
    turns = build_workload(
        trace,
        corpus,
        tokens_per_trace_block=per,
        max_prompt=s.max_prompt,
        prompt_tokens=s.prompt_tokens,
        max_turns=s.max_turns,
    )
    assert [t.index for t in turns] == sorted({t.index for t in turns}), "trace order, once each"
    assert sum(len(t.tokens) for t in turns) <= s.prompt_tokens
    assert max(len(t.tokens) for t in turns) + s.output_tokens <= max_model_len(s)
    # vLLM's pool holds one request of the engine's context (plus its null block)
    assert max_model_len(s) // BLOCK < s.vllm_blocks
    conversations: dict[int, list[Any]] = {}
    for t in turns:
        conversations.setdefault(t.conversation, []).append(t)
        lengths = scaled_length(int(trace.input_lengths[t.index]), len(t.hash_ids), per)
        assert len(t.tokens) == lengths
    assert len(conversations) >= 2, "several conversations, interleaved"
    for conv in conversations.values():
        assert [t.turn for t in conv] == list(range(len(conv)))
        assert 2 <= len(conv) <= s.max_turns
        for later in conv[1:]:
            # a turn continues an earlier one of its conversation: same blocks, same text
            earlier = [e for e in conv if e.index < later.index]
            assert max(_common_prefix(e.hash_ids, later.hash_ids) for e in earlier) >= MIN_SHARED
            for e in earlier:
                blocks = _common_prefix(e.hash_ids, later.hash_ids)
                tokens = min(blocks * per, len(e.tokens), len(later.tokens))
                assert _common_prefix(e.tokens, later.tokens) >= tokens
    # different blocks are different text
    chunks = {
        h: t.tokens[i * per : (i + 1) * per] for t in turns for i, h in enumerate(t.hash_ids[:-1])
    }
    assert len(set(chunks.values())) == len(chunks)
    used = corpus_tokens_used(turns, per)
    assert used == len({h for t in turns for h in t.hash_ids}) * per
    assert max(max(t.tokens) for t in turns) <= used
    if not quick:
        # more to reuse than vLLM's own pool holds, and more than the host budget at bf16
        assert distinct_blocks(turns) > max(s.host_blocks, s.vllm_blocks)


def test_bench_vllm_is_a_bench_suite() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "vllm", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "--quick" in out and "--json" in out and "--host-blocks" in out and "--release" in out


def test_bench_vllm_releases_each_conversation_at_its_last_turn_only() -> None:
    from kvtier.bench.vllm import last_turn_indices
    from kvtier.bench.vllm.workload import Turn

    def turn(conversation: int, t: int) -> Turn:
        return Turn(0, conversation, t, (), ())

    # Turns of conversations 7 and 9 interleave, as the trace's order sends them.
    turns = [turn(7, 0), turn(9, 0), turn(7, 1), turn(9, 1), turn(9, 2), turn(7, 2), turn(4, 0)]
    assert last_turn_indices(turns) == {4, 5, 6}


@pytest.mark.parametrize("capacity", ["0", "-3", "many"])
def test_the_lmcache_peer_refuses_a_capacity_that_is_not_a_positive_count(
    capacity: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.bench.lmcache_peer import main

    with pytest.raises(SystemExit) as exited:
        main(["--capacities", "1000", capacity])
    assert exited.value.code == 2
    assert f"expected a positive integer, got {capacity!r}" in capsys.readouterr().err
