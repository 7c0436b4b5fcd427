"""LMCache's own cache simulator as a peer for kvtier's LRU prefix-cache replay.

LMCache (github.com/LMCache/LMCache, checked with 0.5.6) ships ``lmcache.tools.cache_simulator``:
``simulator.simulate(events, cache_capacity_bytes, kv_bytes_per_chunk, fast=...)`` replays
"lookup-hash" events through an LRU cache of whole chunks. Its input is JSON lines, one event a
request: ``timestamp`` (s), ``model_name``, ``chunk_size``, ``seq_len`` and ``chunk_hashes`` (hex
strings of the request's complete chunks), plus ``shapes``/``dtypes`` from which it derives the
bytes of a chunk. Capacity is given in bytes; it keeps ``capacity_bytes // kv_bytes_per_chunk``
chunks. ``fast=True`` uses an ``OrderedDict`` LRU and skips per-request statistics; ``fast=False``
uses a ``SortedList`` LRU that can also report the LRU position of each hit.

How the runs are made comparable with :func:`kvtier.reference.lru.lru_replay`:

* kvtier's blocks are written as LMCache chunks (``chunk_size`` = the trace's block size, 512
  for Mooncake), *including* a request's partial last block, so both caches see the same keys.
  A live LMCache server would not hash that partial chunk (``full_chunks_only=True`` shows the
  effect of that).
* ``kv_bytes_per_chunk`` is 1 and the capacity is ``capacity_blocks`` bytes, so LMCache holds
  exactly ``capacity_blocks`` chunks. ``None`` (unlimited) becomes the trace's distinct blocks.
* LMCache's headline ``token_hit_rate`` counts ``hit_prefix * chunk_size`` tokens over all
  ``seq_len`` tokens, so a hit partial last block counts as a whole chunk. Its block hit rate is
  ``total_hit_tokens / chunk_size / block refs``; that is the figure to compare. In non-fast mode
  its per-request hit prefixes also give kvtier's token hit rate exactly.
* Its loader sorts events by timestamp (a stable sort); Mooncake traces are already in that order.

lmcache's package ``__init__`` probes for torch and CUDA and logs about it. The simulator needs
none of that (only ``sortedcontainers``), so its two files are loaded by path with importlib,
after checking that they exist in the installed lmcache.

Run ``python benchmarks/lmcache_peer.py [--trace PATH]`` for a JSON table (default trace: the full
Mooncake conversation trace from the shared data folder, else kvtier's bundled slice).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from kvtier.cli import positive_int
from kvtier.reference.lru import lru_replay
from kvtier.results import add_save_option, command, save
from kvtier.traces import Trace, bundled_trace_path, load_trace, to_lmcache_format

INSTALL_HINT = "pip install --no-deps lmcache sortedcontainers"
_SIM_NAME = "lmcache.tools.cache_simulator.simulator"
_LRU_NAME = "lmcache.tools.cache_simulator.lru_cache"
_simulator: ModuleType | None = None


def _load_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_simulator() -> ModuleType:
    """LMCache's ``simulator`` module, loaded without running lmcache's package ``__init__``."""
    global _simulator
    if _simulator is not None:
        return _simulator
    if "lmcache" in sys.modules:  # already imported for real: use it as it is
        import lmcache.tools.cache_simulator.simulator as sim

        _simulator = sim
        return sim
    spec = importlib.util.find_spec("lmcache")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"LMCache is not installed; {INSTALL_HINT}")
    if importlib.util.find_spec("sortedcontainers") is None:
        raise ImportError(f"LMCache's simulator needs sortedcontainers; {INSTALL_HINT}")
    sim_dir = Path(next(iter(spec.submodule_search_locations))) / "tools" / "cache_simulator"
    if not (sim_dir / "simulator.py").is_file() or not (sim_dir / "lru_cache.py").is_file():
        raise ImportError(
            f"this lmcache ({_lmcache_version()}) has no tools/cache_simulator; {INSTALL_HINT}"
        )
    # simulator.py imports lru_cache by its full name; serve that name from the path-loaded
    # file for the duration of the load only, so a later real `import lmcache` is unaffected.
    lru = _load_file(_LRU_NAME, sim_dir / "lru_cache.py")
    sys.modules[_LRU_NAME] = lru
    try:
        sim = _load_file("_kvtier_peer_lmcache_simulator", sim_dir / "simulator.py")
    finally:
        del sys.modules[_LRU_NAME]
    _simulator = sim
    return sim


def _lmcache_version() -> str:
    try:
        return metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return "unknown"


def lmcache_events(trace: Trace, *, full_chunks_only: bool = False) -> list[Any]:
    """``trace`` as LMCache's simulator reads it: written in its JSONL format and loaded back
    with its own loader. Pass the result to :func:`run_lmcache` to replay it several times."""
    sim = load_simulator()
    with tempfile.TemporaryDirectory(prefix="kvtier-lmcache-") as tmp:
        to_lmcache_format(
            trace, Path(tmp) / "lookup_hashes_0.jsonl", full_chunks_only=full_chunks_only
        )
        return list(sim.load_lookup_events([Path(tmp)]))


def run_lmcache(
    trace: Trace,
    capacity_blocks: int | None,
    *,
    fast: bool = True,
    full_chunks_only: bool = False,
    events: list[Any] | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` through LMCache's simulator with room for ``capacity_blocks`` blocks.

    Returns LMCache's own ``hit_rate`` (its token hit rate), the comparable ``block_hit_rate``,
    ``wall_s`` (its replay only) and ``convert_s`` (writing its JSONL and reading it back with
    its loader), among others.
    """
    sim = load_simulator()
    if capacity_blocks is None:
        capacity_blocks = max(1, trace.distinct_blocks)
    if capacity_blocks < 1:
        raise ValueError(f"LMCache's LRU needs capacity_blocks >= 1, got {capacity_blocks}")
    B = trace.block_tokens

    t0 = time.perf_counter()
    if events is None:
        events = lmcache_events(trace, full_chunks_only=full_chunks_only)
    convert_s = time.perf_counter() - t0
    ref_blocks = sum(len(e["chunk_hashes"]) for e in events)

    t0 = time.perf_counter()
    res = sim.simulate(
        events, cache_capacity_bytes=capacity_blocks, kv_bytes_per_chunk=1, fast=fast
    )
    wall_s = time.perf_counter() - t0

    hit_blocks = res["total_hit_tokens"] // B
    token_hit_rate_kvtier = None
    if not fast:  # per-request hit prefixes are only kept in full mode
        hit_tokens = sum(
            min(hp * B, n)
            for hp, n in zip(res["hit_prefix_lengths"], res["input_lengths"], strict=True)
        )
        token_hit_rate_kvtier = hit_tokens / res["total_tokens"] if res["total_tokens"] else 0.0
    return {
        "mode": "fast" if fast else "full",
        "capacity_blocks": res["cache_capacity_chunks"],
        "hit_rate": res["token_hit_rate"],
        "block_hit_rate": hit_blocks / ref_blocks if ref_blocks else 0.0,
        "hit_blocks": hit_blocks,
        "ref_blocks": ref_blocks,
        "token_hit_rate_kvtier": token_hit_rate_kvtier,
        "evictions": res["eviction_count"],
        "requests": res["total_requests"],
        "wall_s": wall_s,
        "convert_s": convert_s,
        "full_chunks_only": full_chunks_only,
        "lmcache_version": _lmcache_version(),
    }


def _default_trace() -> Path:
    env = os.environ.get("KVTIER_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    full = base / "traces" / "mooncake_conversation.jsonl"
    return full if full.is_file() else bundled_trace_path()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=None, help="trace file (default: Mooncake)")
    ap.add_argument("--capacities", type=positive_int, nargs="+", default=[1000, 10000, 50000])
    ap.add_argument("--no-full", action="store_true", help="skip LMCache's slower non-fast mode")
    add_save_option(ap)
    args = ap.parse_args(argv)

    path = args.trace or _default_trace()
    t0 = time.perf_counter()
    trace = load_trace(path)
    load_s = time.perf_counter() - t0

    rows = []
    for cap in args.capacities:
        t0 = time.perf_counter()
        ours = lru_replay(trace, cap)
        ours_s = time.perf_counter() - t0
        row: dict[str, Any] = {
            "capacity_blocks": cap,
            "pymodel": {
                "block_hit_rate": round(ours["block_hit_rate"], 6),
                "token_hit_rate": round(ours["token_hit_rate"], 6),
                "evictions": ours["evictions"],
                "wall_s": round(ours_s, 4),
            },
        }
        for fast in (True, False) if not args.no_full else (True,):
            peer = run_lmcache(trace, cap, fast=fast)
            row[f"lmcache_{peer['mode']}"] = {
                "block_hit_rate": round(peer["block_hit_rate"], 6),
                "lmcache_token_hit_rate": round(peer["hit_rate"], 6),
                "token_hit_rate_kvtier": None
                if peer["token_hit_rate_kvtier"] is None
                else round(peer["token_hit_rate_kvtier"], 6),
                "evictions": peer["evictions"],
                "wall_s": round(peer["wall_s"], 4),
                "convert_s": round(peer["convert_s"], 4),
                "same_hits_as_pymodel": peer["hit_blocks"] == ours["hit_blocks"]
                and peer["evictions"] == ours["evictions"],
            }
        rows.append(row)
    out = {
        "trace": {
            "path": str(path),
            "requests": trace.num_requests,
            "block_refs": trace.block_refs,
            "distinct_blocks": trace.distinct_blocks,
            "load_s": round(load_s, 4),
        },
        "lmcache_version": _lmcache_version(),
        "rows": rows,
    }
    print(json.dumps(out, indent=2))
    if args.save is not None:
        saved = save(args.save, out, command("python benchmarks/lmcache_peer.py", argv))
        print(f"wrote {saved}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
