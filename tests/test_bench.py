"""The benchmarks run end to end and compare like with like."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
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
    assert rows["plain torch int8 encode"]["us"] > 0, "the named baseline is measured in the run"
    # bytes moved: the fp16 input plus exactly the packed rows the codec writes
    fp16 = result["fp16_bytes"]
    assert rows["int4 encode"]["bytes_moved"] == fp16 + fp16 * 11 // 32


def test_bench_manager_quick_prints_figures_beside_baselines() -> None:
    result = _bench("manager", "--quick", "--threads", "1")
    assert result["fp16_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    cpu = next(d for d in result["devices"] if d["device"] == "cpu")
    decode = cpu["decode"]
    assert decode["baseline"]["tokens_per_s"] > 0, "the named baseline is measured in the run"
    work = result["workload"]
    for setting in ("default", "fp16_only"):
        r = decode[setting]
        assert r["tokens"] == decode["baseline"]["tokens"], "same work on both sides"
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_ratio_vs_baseline"] > 0
        assert r["gather"]["count"] == work["sequences"] * work["steps"] * 32
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
