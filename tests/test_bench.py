"""The core benchmark runs end to end and compares like with like."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_core_quick_prints_figures_beside_baselines() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "core", "--quick", "--json", "--no-lmcache"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    result = json.loads(out)
    assert result["stats"]["rust_updates_per_s"] > 0 and result["stats"]["python_updates_per_s"] > 0
    assert result["plan"]["moves"] == result["plan"]["python_moves"], "same work on both sides"
    sim = result["simulate"]
    assert sim["kvtier_lru"]["block_hit_rate"] == sim["python_lru"]["block_hit_rate"]
