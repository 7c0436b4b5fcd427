"""A small, hand-made ``kvtier simulate`` result that follows docs/simulate-schema.md.

Shared by the report and CLI tests; the numbers are made up but consistent with each other.
"""

from __future__ import annotations

import copy
from typing import Any

GiB = 2**30


def _policy(policy: str, hit_blocks: int, by_place: list[tuple[str, str, int]]) -> dict[str, Any]:
    ref_blocks, ref_tokens = 1000, 500_000
    hit_tokens = hit_blocks * 512
    return {
        "policy": policy,
        "ladder": ["bf16", "int8", "int4"],
        "offline": False,
        "source": "kvtier",
        "requests": 40,
        "ref_blocks": ref_blocks,
        "hit_blocks": hit_blocks,
        "ref_tokens": ref_tokens,
        "hit_tokens": hit_tokens,
        "block_hit_rate": hit_blocks / ref_blocks,
        "token_hit_rate": hit_tokens / ref_tokens,
        "rejected_requests": 0,
        "hits_by_place": [
            {"tier": t, "level": lv, "blocks": n, "tokens": n * 512} for t, lv, n in by_place
        ],
        "bytes_by_place": [
            {"tier": "device", "level": "bf16", "blocks": 100, "bytes": 100 * 64 * 2**20},
            {"tier": "device", "level": "int8", "blocks": 200, "bytes": 200 * 32 * 2**20},
            {"tier": "host", "level": "bf16", "blocks": 50, "bytes": 50 * 64 * 2**20},
        ],
        "peak_bytes_by_tier": {"device": 16 * GiB, "host": 4 * GiB},
        "moves": {
            "promotions": 3,
            "demotions": 120,
            "offloads": 50,
            "fetches": 7,
            "evictions": 900,
            "noop_promotions": 2,
            "bytes_moved": 5 * GiB,
        },
        "allocated_blocks": 1000 - hit_blocks,
        "released_blocks": 650,
        "prefill": {
            "baseline_s": 33.0,
            "with_cache_s": 33.0 * (1 - hit_blocks / ref_blocks),
            "saved_s": 33.0 * hit_blocks / ref_blocks,
            "saved_fraction": hit_blocks / ref_blocks,
            "cost_model": "prefill time linear in uncached tokens at 15,000 tokens/s",
        },
        "wall_s": 0.0123,
        "timeline": {
            "request": [10, 20, 30, 40],
            "time_s": [1.0, 2.0, 3.0, 4.0],
            "block_hit_rate": [0.0, 0.05, hit_blocks / ref_blocks / 2, hit_blocks / ref_blocks],
            "bytes_by_level": {
                "bf16": [GiB, 2 * GiB, 3 * GiB, 3 * GiB],
                "int8": [0, GiB // 2, GiB, 2 * GiB],
                "int4": [0, 0, GiB // 4, GiB // 2],
            },
        },
    }


_SAMPLE: dict[str, Any] = {
    "trace": {
        "path": "/somewhere/mooncake_conversation_head.jsonl.gz",
        "format": "mooncake",
        "requests": 40,
        "block_refs": 1000,
        "distinct_blocks": 700,
        "block_tokens": 512,
        "duration_s": 95.5,
    },
    "model": {
        "name": "llama3-8b",
        "layers": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "dtype": "bf16",
        "bytes_per_token": {"bf16": 131072.0, "int8": 66560.0, "int4": 33792.0},
    },
    "tiers": [
        {"tier": "device", "budget_bytes": 64 * GiB, "gbps": None},
        {"tier": "host", "budget_bytes": 512 * GiB, "gbps": 25.0},
    ],
    "results": [
        _policy("lru", 41, [("device", "bf16", 30), ("host", "bf16", 11)]),
        _policy(
            "importance", 84, [("device", "bf16", 30), ("device", "int8", 40), ("host", "bf16", 14)]
        ),
    ],
}


def sample_result(policies: int = 2) -> dict[str, Any]:
    """A fresh copy of the sample, with its first ``policies`` policy results."""
    result = copy.deepcopy(_SAMPLE)
    result["results"] = result["results"][:policies]
    return result
