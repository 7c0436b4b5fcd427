"""kvtier inside vLLM's native two-tier offloading, on this machine: hit rates on a trace, tokens
held, and the tier's store and load throughput.

    python benchmarks/vllm_tiering.py [--trace T] [--requests N] [--chunks 2000,5000]
        [--out DIR]

1. **Hit rates** (``hits-B.json`` per primary size B chunks): the trace replayed through vLLM's
   ``TieringOffloadingManager`` (:mod:`kvtier.bench.tiering`: a real ``SharedOffloadRegion``,
   each chunk's bytes written into it, lookups as vLLM's connector makes them) with one bf16 CPU
   tier of 2B chunks under vLLM's LRU, its ARC and kvtier's policy, against a CPU tier of B
   under each with ``KvtierTier`` (``bf16,int8,int4``, B's bytes) behind it, and under LRU with
   a ``bf16``-only ``KvtierTier`` of B's bytes (a second plain tier). Chunks of 64 tokens
   (``block_size: 64`` over 16-token GPU blocks), 1 layer of 2 KV heads of 64.
2. **Tokens held** (``held.json``): a tier of B bytes filled with four times as many distinct
   chunks as a bf16 copy of B holds, with ``bf16,int8,int4`` and with ``bf16``, at 16- and
   64-token chunks; the tokens it holds over those B bytes hold at bf16.
3. **Throughput** (``throughput.json``): store and load jobs of 32 chunks of a Llama-3-8B-sized
   model (32 layers, 8 KV heads of 128, 16 tokens: 2 MiB a chunk) straight through the tier's
   ``submit_store``/``submit_load`` (level 0, then ``bf16,int8,int4`` demoting), in GB/s of
   chunk bytes, against a plain copy of the same rows (``numpy.copyto``) in the same run.

Prints each figure as it goes and writes the JSON files to ``--out``, each with the run's
provenance (command, date, commit, machine, versions; :mod:`kvtier.results`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.tiering import ChunkGeometry, TwoTiers, kvtier_tier, offloading_spec, replay
from kvtier.results import command
from kvtier.results import save as save_result
from kvtier.traces import load_trace

TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/mooncake_conversation.jsonl"
HITS_GEOMETRY = ChunkGeometry(layers=1, kv_heads=2, head_dim=64, block_size=64, blocks_per_chunk=4)
LADDER = "bf16,int8,int4"


def hit_rates(trace: Any, chunks: int) -> dict[str, Any]:
    g = HITS_GEOMETRY
    tier_bytes = str(chunks * g.chunk_bytes)
    configs: list[tuple[str, str, int, list[dict[str, Any]]]] = [
        ("vllm-lru 2B", "lru", 2 * chunks, []),
        ("vllm-arc 2B", "arc", 2 * chunks, []),
        ("kvtier-policy 2B", "kvtier", 2 * chunks, []),
        (
            "vllm-lru B + KvtierTier B",
            "lru",
            chunks,
            [kvtier_tier(g, host_budget=tier_bytes, ladder=LADDER)],
        ),
        (
            "vllm-arc B + KvtierTier B",
            "arc",
            chunks,
            [kvtier_tier(g, host_budget=tier_bytes, ladder=LADDER)],
        ),
        (
            "kvtier-policy B + KvtierTier B",
            "kvtier",
            chunks,
            [kvtier_tier(g, host_budget=tier_bytes, ladder=LADDER)],
        ),
        (
            "vllm-lru B + bf16 KvtierTier B",
            "lru",
            chunks,
            [kvtier_tier(g, host_budget=tier_bytes, ladder="bf16")],
        ),
    ]
    total = int(trace.blocks_per_request.sum())
    out: dict[str, Any] = {"primary_chunks_B": chunks, "trace_blocks": total, "configs": {}}
    for name, policy, primary, tiers in configs:
        start = time.perf_counter()
        hits, held = replay(trace, g, primary, policy=policy, tiers=tiers)
        row = {
            "policy": policy,
            "primary_chunks": primary,
            "secondary": tiers[0]["ladder"] if tiers else None,
            "hit_blocks": int(hits.sum()),
            "block_hit_rate": float(hits.sum() / total),
            "tier_chunks_held": held.get("chunks"),
            "seconds": time.perf_counter() - start,
        }
        out["configs"][name] = row
        print(
            f"B={chunks}: {name}: hit rate {row['block_hit_rate']:.2%}"
            + (f", tier holds {row['tier_chunks_held']} chunks" if tiers else "")
            + f" ({row['seconds']:.0f} s)",
            flush=True,
        )
    return out


def tokens_held(chunks: int) -> dict[str, Any]:
    """A tier of ``chunks`` bf16 chunks' bytes, offered 4x as many distinct chunks."""
    out: dict[str, Any] = {}
    for tokens, per_chunk in ((16, 1), (64, 4)):
        g = ChunkGeometry(
            layers=1, kv_heads=2, head_dim=64, block_size=tokens, blocks_per_chunk=per_chunk
        )
        for ladder in (LADDER, "bf16"):
            cfg = kvtier_tier(g, host_budget=str(chunks * g.chunk_bytes), ladder=ladder)
            spec = offloading_spec(g, 64, tiers=[cfg])
            run = TwoTiers(spec, g, lambda key, g=g: g.pages(int.from_bytes(key[:8], "big")))
            try:
                from vllm.v1.kv_offload.base import make_offload_key

                for r in range(4 * chunks // 32):
                    keys = [
                        make_offload_key((32 * r + i + 1).to_bytes(8, "big"), 0) for i in range(32)
                    ]
                    run.request(str(r), keys)
                tier = run.tiers[0]
                held = len(tier.manager.core.indexed_blocks())
                levels = np.bincount(
                    tier.manager.core.block_info(tier.manager.core.indexed_blocks())["level"],
                    minlength=len(tier.manager.ladder),
                )
            finally:
                run.close()
            key = f"{tokens}-token chunks, {ladder}"
            out[key] = {
                "chunk_tokens": tokens,
                "ladder": ladder,
                "budget_bytes": chunks * g.chunk_bytes,
                "bf16_chunks_in_budget": chunks,
                "chunks_held": held,
                "chunks_per_level": levels.tolist(),
                "tokens_held_over_bf16": held / chunks,
            }
            print(
                f"{key}: holds {held} chunks for {chunks} at bf16: {held / chunks:.2f}x", flush=True
            )
    return out


def timed_jobs(
    tier: Any, keys: list[Any], slots: np.ndarray, per_job: int, promotion: bool
) -> float:
    """Seconds for the tier to run store (or, with ``promotion``, load) jobs of ``per_job`` of
    ``keys`` between their primary ``slots``, submitted at once, until all are done."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    context = ReqContext(req_id="bench")
    start = time.perf_counter()
    for j in range(0, len(keys), per_job):
        job = TransferJob(j, keys[j : j + per_job], slots[j : j + per_job], promotion, context)
        (tier.submit_load if promotion else tier.submit_store)(job)
    tier.drain_jobs()
    took = time.perf_counter() - start
    results = list(tier.get_finished_jobs())
    assert all(r.success for r in results), results
    return took


def throughput(chunks: int = 256, per_job: int = 32) -> dict[str, Any]:
    """Store and load jobs straight through the tier, against a plain copy of the same rows; a
    first round of other chunks touches every page of the tier's pools and the copy's buffer."""
    from vllm.v1.kv_offload.base import make_offload_key

    g = ChunkGeometry(layers=32, kv_heads=8, head_dim=128, block_size=16)
    n = chunks
    out: dict[str, Any] = {"chunk_bytes": g.chunk_bytes, "chunks": n, "chunks_per_job": per_job}
    for ladder in ("bf16", LADDER):
        cfg = kvtier_tier(g, host_budget=str(2 * n * g.chunk_bytes), ladder=ladder)
        run = TwoTiers(offloading_spec(g, 2 * n, tiers=[cfg]), g, lambda key: g.pages(0))
        tier = run.tiers[0]
        try:
            for c in range(2 * n):
                run.rows[c, : g.chunk_bytes] = g.pages(c + 1).view(np.uint8).ravel()
            keys = [make_offload_key((c + 1).to_bytes(8, "big"), 0) for c in range(2 * n)]
            slots = np.arange(2 * n)
            timed_jobs(tier, keys[n:], slots[n:], per_job, False)  # the warm-up round
            store_s = timed_jobs(tier, keys[:n], slots[:n], per_job, False)
            load_s = timed_jobs(tier, keys[:n], slots[n:], per_job, True)  # into other rows
            copy = np.ones((n, g.chunk_bytes), dtype=np.uint8)
            start = time.perf_counter()
            np.copyto(copy, run.rows[:n, : g.chunk_bytes])
            copy_out_s = time.perf_counter() - start
            start = time.perf_counter()
            np.copyto(run.rows[n:, : g.chunk_bytes], copy)
            copy_in_s = time.perf_counter() - start
        finally:
            run.close()
        nbytes = n * g.chunk_bytes
        row = {
            "store_GBps": nbytes / store_s / 1e9,
            "load_GBps": nbytes / load_s / 1e9,
            "plain_copy_out_GBps": nbytes / copy_out_s / 1e9,
            "plain_copy_in_GBps": nbytes / copy_in_s / 1e9,
        }
        row["store_over_copy"] = row["store_GBps"] / row["plain_copy_out_GBps"]
        row["load_over_copy"] = row["load_GBps"] / row["plain_copy_in_GBps"]
        out[ladder] = row
        print(
            f"throughput {ladder}: store {row['store_GBps']:.2f} GB/s, load "
            f"{row['load_GBps']:.2f} GB/s; plain copy out {row['plain_copy_out_GBps']:.2f}, "
            f"in {row['plain_copy_in_GBps']:.2f} GB/s",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=None, help="the first N requests (all)")
    ap.add_argument("--chunks", default="2000,5000", help="primary sizes B, in chunks")
    ap.add_argument("--out", default=None, help="write the JSON files here")
    ap.add_argument("--only", default="hits,held,throughput")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))

    def save(name: str, data: dict[str, Any]) -> None:
        data["loadavg_1m"] = os.getloadavg()[0]
        if out is not None:
            save_result(out / name, data, command("python benchmarks/vllm_tiering.py", argv))

    if "throughput" in only:
        save("throughput.json", throughput())
    if "held" in only:
        save("held.json", tokens_held(1024))
    if "hits" in only:
        trace = load_trace(args.trace)
        if args.requests is not None:
            trace = trace.head(args.requests)
        for chunks in [int(c) for c in args.chunks.split(",")]:
            save(f"hits-{chunks}.json", hit_rates(trace, chunks))


if __name__ == "__main__":
    main()
