"""``vllm serve`` with the connector, as a user runs it: vLLM's own processes (scheduler and
worker apart, so the scheduler asks the worker's tiers over its socket), an HTTP server on a
loopback port, and kvtier's counters on vLLM's ``/metrics``.

One server for the file (the ``served`` fixture; starting one takes most of a minute, so the run
starts it early, see conftest.py): a prefill engine whose connector keeps prompt blocks in its
host tier and publishes them to a real redis-server, from which a decode engine in this process
(``kv_consumer``) loads them. Each test sends prompts of its own and counts what the server's
figures gained."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from vllm_engines import (
    BLOCK,
    Server,
    close,
    connector,
    generate,
    loadable_blocks,
    make_engine,
    metric,
    wikitext_prompts,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis]  # every test here uses the served fixture


def test_vllm_serve_loads_a_prompt_from_kvtier_and_reports_it_on_metrics(
    served: Server, vllm_model_dir: Path
) -> None:
    """One prompt: computed, then from vLLM's own prefix cache, then, that cache emptied,
    loaded from kvtier's host tier; the counters on ``/metrics`` say so."""
    [prompt] = wikitext_prompts(vllm_model_dir, [6 * BLOCK + 5], skip=4000)
    before = served.metrics()
    served.complete([prompt])  # computed, and saved
    [cached] = served.complete([prompt])  # vLLM's own prefix hit
    served.reset_prefix_cache()
    [loaded] = served.complete([prompt])  # kvtier's
    # A load gives what vLLM's own prefix hit gives: the same blocks in its pool, the rest
    # computed alike (a recompute runs other kernels: on a CPU with AMX, other rounding).
    assert loaded["text"] == cached["text"]
    text = served.metrics()

    def gained(name: str, label: str = "") -> float:
        return metric(text, name, label) - metric(before, name, label)

    loadable = loadable_blocks(prompt)
    assert gained("vllm:kvtier_saved_blocks_total") == len(prompt) // BLOCK
    assert gained("vllm:kvtier_loaded_blocks_total") == loadable
    # Bytes of vLLM's bf16 blocks (30 layers, K and V, 3 heads x 32 tokens x 64 channels) and
    # the seconds the saves and loads took; the host tier's use as gauges.
    block_bytes = 30 * 2 * 3 * BLOCK * 64 * 2
    assert gained("vllm:kvtier_saved_bytes_total") == len(prompt) // BLOCK * block_bytes
    assert gained("vllm:kvtier_loaded_bytes_total") == loadable * block_bytes
    assert gained("vllm:kvtier_save_seconds_total") > 0
    assert gained("vllm:kvtier_load_seconds_total") > 0
    held = metric(text, "vllm:kvtier_host_held_bytes")
    assert len(prompt) // BLOCK * block_bytes <= held
    assert held <= metric(text, "vllm:kvtier_host_capacity_bytes") <= 64 * 2**20
    assert metric(text, "vllm:kvtier_load_errors_total") == 0
    assert gained("vllm:external_prefix_cache_hits_total") == loadable * BLOCK
    # ... from host memory, as the scheduler's lookup over the worker's socket found them.
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert gained(by_source, 'source="host"') == loadable * BLOCK
    assert gained(by_source) == gained(by_source, 'source="device"') + loadable * BLOCK


def test_a_decode_engine_loads_what_vllm_serve_published_to_redis_and_survives_faults(
    served: Server, vllm_model_dir: Path
) -> None:
    """The server (the prefill side) publishes its prompts' blocks to the redis-server; a
    decode engine here (``kv_consumer``, nothing in its own tiers) loads them from there and
    generates the tokens the server's prefix hit gives. Then the faults: values damaged on the
    server fail their checksum and are recomputed; the server killed mid-run is a miss, not a
    hang. (Runs last in this file: it kills the redis-server.)"""
    import redis

    prompts = wikitext_prompts(vllm_model_dir, [(2 + i) * BLOCK + 7 for i in range(4)], skip=6000)

    # One request at a time, here and in the decode engine: a step's other requests change the
    # rounding of its matrix products on this CPU (AMX), and background loads that end at
    # different steps would batch the requests differently from one pass to the next.
    def tokens(prompts: list[list[int]]) -> list[list[int]]:
        return [served.complete([p])[0]["token_ids"] for p in prompts]

    def decoded(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
        return [list(generate(llm, [p])[0].token_ids) for p in prompts]

    # What a recompute gives (the first pass), and what a prefix hit gives (the second: the same
    # blocks in vLLM's pool, the rest computed alike; a recompute runs other kernels over the
    # prompt, on a CPU with AMX with other rounding).
    computed = tokens(prompts)  # saved and published too
    want = tokens(prompts)
    hits = "vllm:external_prefix_cache_hits_total"
    before = metric(served.metrics(), hits)
    served.reset_prefix_cache()
    assert tokens(prompts) == want  # from its host tier
    assert metric(served.metrics(), hits) - before == BLOCK * sum(map(loadable_blocks, prompts))
    raw = redis.Redis.from_url(served.redis.url)
    published = sum(len(p) // BLOCK for p in prompts)
    deadline = time.monotonic() + 60
    while raw.dbsize() < published:  # published at the server's next steps
        assert time.monotonic() < deadline, (raw.dbsize(), published)
        time.sleep(0.5)

    consumer = make_engine(
        vllm_model_dir,
        role="kv_consumer",
        host_budget="64MiB",
        ladder="bf16",
        remote_url=served.redis.url,
    )
    try:
        conn = connector(consumer)
        got = decoded(consumer, prompts[:2])
        stats = dict(conn.get_compression_stats()["connector"])
        assert stats["loaded_blocks"] == sum(loadable_blocks(p) for p in prompts[:2])
        assert stats["saved_blocks"] == 0  # a consumer only loads
        # Found on the server (vLLM's source: external_unspecified), at level 0.
        assert stats["hit_tokens_by_tier"]["remote"] == BLOCK * stats["loaded_blocks"]
        assert stats["hit_tokens_by_level"] == {"bf16": stats["hit_tokens"]}
        assert got == want[:2]
        # Flip one byte in the middle of every value on the server.
        for key in raw.scan_iter():
            value = bytearray(raw.get(key) or b"")
            value[len(value) // 2] ^= 0xFF
            raw.set(key, bytes(value), keepttl=True)
        got = decoded(consumer, prompts[2:3])
        after = dict(conn.get_compression_stats()["connector"])
        assert after["loaded_blocks"] == stats["loaded_blocks"]  # nothing more was loaded
        assert after["load_errors"] > stats["load_errors"]  # found, refused, recomputed
        assert got == computed[2:3]
        served.redis.kill()
        t = time.monotonic()
        got = decoded(consumer, prompts[3:])
        assert time.monotonic() - t < 120
        assert got == computed[3:]
        assert conn.get_compression_stats()["connector"]["loaded_blocks"] == after["loaded_blocks"]
    finally:
        close(consumer)
