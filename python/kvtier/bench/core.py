"""``kvtier bench core``: the Rust core against plain Python doing the same work, in one run.

- statistics: batch read updates per second (10M updates over 1M blocks), beside the same decayed
  counter update written in plain Python;
- plan: ``plan()`` over 1M blocks in 1,000 sequences, beside the plain-Python model of the rules;
- simulate: a full-precision LRU replay of the Mooncake conversation trace, beside the
  plain-Python LRU replay and LMCache's own simulator (fast and full modes) at the same capacity
  (hit rates must agree); and the full tier model (int8/int4 ladder, host tier) with the
  importance policy.

Prints a table on stderr and JSON on stdout (``--json``: JSON only). The Rust loops alone, without
Python: ``cargo run --release -p kvtier --example plan`` (plan and read updates) and ``--example
replay TRACE.jsonl`` (the LRU replay).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._core import Core
from ..cli import positive_int
from ..reference.core import ModelCore
from ..reference.lru import lru_replay, model_replay
from ..results import save_if_asked
from ..simulate import SimulationConfig, run
from ..traces import Trace, bundled_trace_path, load_trace
from . import bench_parser, run_as_script

MOONCAKE = "traces/mooncake_conversation.jsonl"


class Seconds(float):
    """A time in seconds (the best or the median of ``samples``) that keeps every sample, in
    the order timed, so that a result can carry the spread beside its figure. Arithmetic on it
    gives plain floats."""

    samples: tuple[float, ...]

    def __new__(cls, value: float, samples: Sequence[float]) -> Seconds:
        self = super().__new__(cls, value)
        self.samples = tuple(samples)
        return self


def best_of(repeats: int, fn: Callable[[], Any]) -> Seconds:
    """The best of ``repeats`` calls of ``fn``, keeping each call's time."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Seconds(min(times, default=float("inf")), times)


#: A timer of the kernel benches: ``timer(fn, repeats)`` -> seconds per call, with its samples.
Timer = Callable[[Callable[[], Any], int], Seconds]


def cpu_time(fn: Callable[[], Any], repeats: int) -> Seconds:
    """Seconds of the best of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()
    return best_of(repeats, fn)


def gpu_time(fn: Callable[[], Any], repeats: int) -> Seconds:
    """Seconds of the median of ``repeats`` calls of ``fn`` timed by CUDA events on the current
    torch stream, after three warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return Seconds(statistics.median(times), times)


CORE_ARGS: dict[str, Any] = {"block_size": 16, "recent_window": 64}
LEVEL_BYTES = [4096, 2080, 1160]


def _populate(
    core: Any, n_blocks: int, n_seqs: int, *, as_lists: bool = False, seed: int = 0
) -> Any:
    """Fills a core (or the plain-Python model) with ``n_blocks`` blocks in ``n_seqs`` sequences,
    each with a magnitude, identically for both."""
    rng = np.random.default_rng(seed)
    per_seq = n_blocks // n_seqs
    for s in range(n_seqs):
        seq = core.add_sequence()
        hashes = np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.uint64) + 1
        magnitude = rng.random(per_seq, dtype=np.float32)
        if as_lists:
            blocks, _ = core.append_blocks(seq, hashes.tolist())
            core.set_magnitude(blocks, magnitude.tolist())
        else:
            blocks, _ = core.append_blocks(seq, hashes)
            core.set_magnitude(blocks, magnitude)
    return core


def _populated_core(n_blocks: int, n_seqs: int) -> Core:
    return _populate(Core(LEVEL_BYTES, **CORE_ARGS), n_blocks, n_seqs)


def _populated_model(n_blocks: int, n_seqs: int) -> ModelCore:
    return _populate(ModelCore(LEVEL_BYTES, **CORE_ARGS), n_blocks, n_seqs, as_lists=True)


def bench_stats(n_blocks: int, n_updates: int, py_updates: int) -> dict[str, Any]:
    core = _populated_core(n_blocks, max(1, n_blocks // 1000))
    ids = np.random.default_rng(1).integers(0, n_blocks, n_updates, dtype=np.uint32)
    rust_s = best_of(3, lambda: core.record_reads(ids))
    model = _populated_model(n_blocks, max(1, n_blocks // 1000))
    py_ids = ids[:py_updates].tolist()
    py_s = best_of(1, lambda: model.record_reads(py_ids))
    rust_rate = n_updates / rust_s
    py_rate = py_updates / py_s
    return {
        "blocks": n_blocks,
        "updates": n_updates,
        "rust_updates_per_s": rust_rate,
        "rust_updates_per_s_samples": [n_updates / t for t in rust_s.samples],
        "python_updates_per_s": py_rate,
        "python_updates_timed": py_updates,
        "speedup": rust_rate / py_rate,
        "target_updates_per_s": 20e6,
    }


#: Steady plans timed (the best counts): 11 of about 40 ms each give the plan, like the replay,
#: several chances at a quiet moment of a shared VM, where 3 often found none.
STEADY_PLAN_REPEATS = 11


def bench_plan(n_blocks: int, n_seqs: int, python: bool) -> dict[str, Any]:
    core = _populated_core(n_blocks, n_seqs)
    first = core.plan()
    t0 = time.perf_counter()
    core.abort(first.id)
    abort_s = time.perf_counter() - t0

    def plan_and_abort() -> None:
        plan = core.plan()
        core.abort(plan.id)

    plans = best_of(3, plan_and_abort)
    rust_s = plans - abort_s
    plan = core.plan()
    core.commit(plan.id)
    steady_s = best_of(STEADY_PLAN_REPEATS, plan_and_abort)
    out: dict[str, Any] = {
        "blocks": n_blocks,
        "sequences": n_seqs,
        "moves": len(first),
        "rust_plan_ms": rust_s * 1e3,
        "rust_plan_ms_samples": [(t - abort_s) * 1e3 for t in plans.samples],
        "rust_steady_plan_ms": steady_s * 1e3,
        "rust_steady_plan_ms_samples": [t * 1e3 for t in steady_s.samples],
        "target_ms": 50.0,
    }
    if python:
        model = _populated_model(n_blocks, n_seqs)
        t0 = time.perf_counter()
        py_plan = model.plan()
        py_s = time.perf_counter() - t0
        out["python_moves"] = len(py_plan.moves)  # same work: must equal "moves"
        out["python_plan_ms"] = py_s * 1e3
        out["speedup"] = py_s / rust_s
    return out


def _trace_path() -> Path:
    """The full Mooncake trace from the shared data folder (``KVTIER_SHARED_DATA``, else
    ``../shared/data`` beside the checkout), else the bundled slice."""
    data = Path(os.environ.get("KVTIER_SHARED_DATA", Path.cwd().parent / "shared" / "data"))
    full = data / MOONCAKE
    return full if full.is_file() else Path(bundled_trace_path())


#: Replays of the LRU comparison, kvtier's and LMCache's fast mode taking turns: the best of
#: each counts. Taking turns puts both under the same machine noise (on a shared VM one 30 ms
#: replay can take twice as long as the next, for minutes at a time); 11 turns (about 2 s)
#: give each side more chances at a quiet moment than 5 did, so the ratio varies less.
REPLAY_REPEATS = 11


#: Requests of the trace's head that the plain-Python model replays (``--quick``: 200): its
#: evictions sort the cache, so the whole trace would take minutes.
MODEL_REQUESTS = 1000


def bench_model_replay(head: Trace, capacity: int, cfg: SimulationConfig) -> dict[str, Any]:
    """The same replay, call for call, through the plain-Python model and through the core."""
    t0 = time.perf_counter()
    model = model_replay(head, capacity)
    model_s = time.perf_counter() - t0
    runs = [run(head, cfg, policies=["lru"])["results"][0] for _ in range(3)]
    rust = min(runs, key=lambda r: r["wall_s"])
    return {
        "requests": len(head),
        "block_hit_rate": model["block_hit_rate"],
        "kvtier_block_hit_rate": rust["block_hit_rate"],  # same work: must be equal
        "wall_s": model_s,
        "kvtier_wall_s": rust["wall_s"],
        "kvtier_wall_s_samples": [r["wall_s"] for r in runs],
        "speedup": model_s / rust["wall_s"],
    }


def bench_simulate(
    trace: Trace, capacity: int, lmcache: bool, model_requests: int = MODEL_REQUESTS
) -> dict[str, Any]:
    lru_cfg = SimulationConfig(device_blocks=capacity, ladder=("fp16",))
    events = None
    out: dict[str, Any] = {"requests": len(trace), "capacity_blocks": capacity}
    if lmcache:
        from .lmcache_peer import lmcache_events, run_lmcache

        try:
            events = lmcache_events(trace)
        except ImportError as e:
            out["lmcache"] = f"skipped: {e}"
    rust = {"wall_s": float("inf")}
    fast: dict[str, Any] = {"wall_s": float("inf")}
    walls: dict[str, list[float]] = {"kvtier": [], "fast": []}
    # Plain LRU: the work the plain-Python LRU and LMCache's simulator do.
    for _ in range(REPLAY_REPEATS):
        r = run(trace, lru_cfg, policies=["plain-lru"])["results"][0]
        rust = min(rust, r, key=lambda x: x["wall_s"])
        walls["kvtier"].append(r["wall_s"])
        if events is not None:
            peer = run_lmcache(trace, capacity, fast=True, events=events)
            fast = min(fast, peer, key=lambda x: x["wall_s"])
            walls["fast"].append(peer["wall_s"])
    t0 = time.perf_counter()
    py = lru_replay(trace, capacity)
    py_s = time.perf_counter() - t0
    out |= {
        "kvtier_lru": {
            "block_hit_rate": rust["block_hit_rate"],
            "wall_s": rust["wall_s"],
            "wall_s_samples": walls["kvtier"],
        },
        "python_lru": {"block_hit_rate": py["block_hit_rate"], "wall_s": py_s},
        "speedup_vs_python": py_s / rust["wall_s"],
        "python_model": bench_model_replay(trace.head(model_requests), capacity, lru_cfg),
    }
    if events is not None:
        full = run_lmcache(trace, capacity, fast=False, events=events)  # slow: once
        for mode, peer in (("fast", fast), ("full", full)):
            out[f"lmcache_{mode}"] = {
                "block_hit_rate": peer["block_hit_rate"],
                "wall_s": peer["wall_s"],
                "wall_s_samples": walls["fast"] if mode == "fast" else [peer["wall_s"]],
            }
            out[f"speedup_vs_lmcache_{mode}"] = peer["wall_s"] / rust["wall_s"]
    full_cfg = SimulationConfig(
        device_blocks=capacity,
        host_bytes=4 * capacity * lru_cfg.shape().block_bytes("fp16", 512),
        ladder=("fp16", "int8", "int4"),
    )
    full = run(trace, full_cfg, policies=["importance"])["results"][0]
    out["kvtier_importance_tiers"] = {
        "ladder": full["ladder"],
        "tiers": "device + host (4x device)",
        "block_hit_rate": full["block_hit_rate"],
        "wall_s": full["wall_s"],
        "target_s": 1.0,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("core", __doc__, "100k blocks and the bundled trace", "print only the JSON")
    ap.add_argument(
        "--trace", type=Path, default=None, help="Mooncake trace (default: ../shared, else bundled)"
    )
    ap.add_argument(
        "--capacity",
        type=positive_int,
        default=10_000,
        help="cache blocks for the replay comparison",
    )
    ap.add_argument("--no-lmcache", action="store_true", help="skip the LMCache peer")
    ap.add_argument("--no-python-plan", action="store_true", help="skip the slow plain-Python plan")
    args = ap.parse_args(argv)

    n_blocks = 100_000 if args.quick else 1_000_000
    trace_path = args.trace or (Path(bundled_trace_path()) if args.quick else _trace_path())
    trace = load_trace(trace_path)
    log = (lambda *_: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    log(f"kvtier bench core: {n_blocks:,} blocks; trace {trace_path} ({len(trace):,} requests)")
    result = {
        "stats": bench_stats(n_blocks, 10 * n_blocks, min(1_000_000, n_blocks)),
        "plan": bench_plan(n_blocks, max(1, n_blocks // 1000), python=not args.no_python_plan),
        "simulate": bench_simulate(
            trace,
            args.capacity,
            lmcache=not args.no_lmcache,
            model_requests=200 if args.quick else MODEL_REQUESTS,
        ),
    }
    s, p, m = result["stats"], result["plan"], result["simulate"]
    log(
        f"stats     {s['rust_updates_per_s'] / 1e6:8.1f} M updates/s  (plain Python {s['python_updates_per_s'] / 1e6:.2f} M/s, x{s['speedup']:.0f}; target >= 20 M/s)"
    )
    log(
        f"plan      {p['rust_steady_plan_ms']:8.1f} ms over {p['blocks']:,} blocks (steady; target <= 50 ms); "
        f"first plan {p['rust_plan_ms']:.1f} ms ({p['moves']:,} moves)"
        + (
            f"  (plain Python {p['python_plan_ms']:.0f} ms, x{p['speedup']:.0f})"
            if "speedup" in p
            else ""
        )
    )
    log(
        f"simulate  kvtier LRU {m['kvtier_lru']['wall_s'] * 1e3:.1f} ms, plain-Python OrderedDict LRU (no block table) {m['python_lru']['wall_s'] * 1e3:.1f} ms (x{m['speedup_vs_python']:.1f})"
    )
    pm = m["python_model"]
    log(
        f"          first {pm['requests']:,} requests: kvtier {pm['kvtier_wall_s'] * 1e3:.1f} ms, plain-Python model (same calls; sorts the cache per eviction) {pm['wall_s']:.1f} s (x{pm['speedup']:.0f})"
    )
    for mode in ("fast", "full"):
        if f"lmcache_{mode}" in m:
            log(
                f"          LMCache {mode}: {m[f'lmcache_{mode}']['wall_s'] * 1e3:.1f} ms (kvtier x{m[f'speedup_vs_lmcache_{mode}']:.1f}{'; target >= 10x' if mode == 'fast' else ''}), hit rate {m[f'lmcache_{mode}']['block_hit_rate']:.4%} vs kvtier {m['kvtier_lru']['block_hit_rate']:.4%}"
            )
    imp = m["kvtier_importance_tiers"]
    log(
        f"          importance + int8/int4 + host tier: {imp['wall_s'] * 1e3:.1f} ms, hit rate {imp['block_hit_rate']:.2%} (target < 1 s)"
    )
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    save_if_asked(args, result, ap.prog, argv)
    return 0


if __name__ == "__main__":
    run_as_script("core")
