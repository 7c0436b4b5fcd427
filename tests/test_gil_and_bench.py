"""Batch calls release the GIL; the core benchmark runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np

import kvtier


def test_batch_calls_release_the_gil() -> None:
    core = kvtier.Core([64])
    seq = core.add_sequence()
    blocks, _ = core.append_blocks(seq, np.arange(1, 100_001, dtype=np.uint64))
    ids = np.resize(blocks, 20_000_000)  # long enough to take a good fraction of a second
    done = threading.Event()
    ticks = 0

    def rust() -> None:
        core.record_reads(ids)
        done.set()

    worker = threading.Thread(target=rust)
    worker.start()
    while not done.is_set():  # pure Python: runs only while the Rust call does not hold the GIL
        ticks += 1
    worker.join()
    # A call holding the GIL would leave this loop a handful of iterations (switch interval 5 ms).
    assert ticks > 10_000, f"only {ticks} Python iterations ran during the batch call"


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
