"""Plain-Python reference models, the baselines the Rust core is checked and timed against.

They are deliberately written the way one would without kvtier: dicts and loops, no numpy in the
replay loop (the trace's arrays are turned into Python lists once, before it starts).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypedDict

from kvtier.traces import Trace

__all__ = ["LruResult", "lru_replay"]


class LruResult(TypedDict):
    requests: int
    capacity_blocks: int | None
    hit_blocks: int
    ref_blocks: int
    hit_tokens: int
    ref_tokens: int
    block_hit_rate: float
    token_hit_rate: float
    evictions: int


def lru_replay(trace: Trace, capacity_blocks: int | None) -> LruResult:
    """Exact LRU prefix-cache replay of ``trace`` with room for ``capacity_blocks`` blocks
    (``None`` = unlimited).

    For each request, in trace order: its hit is the longest prefix of its block ids that are
    all cached; then all of its blocks are touched or inserted in order (so its last block ends
    up most recent), evicting least-recently-used blocks while the cache is over capacity.
    A hit block counts ``block_tokens`` tokens, except a request's last block, which counts the
    tokens it really holds: ``input_length - (n_blocks - 1) * block_tokens``.
    """
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
    offsets: list[int] = trace.hash_offsets.tolist()
    ids: list[int] = trace.hash_ids.tolist()
    lengths: list[int] = trace.input_lengths.tolist()
    B = trace.block_tokens
    cap = capacity_blocks

    cache: OrderedDict[int, None] = OrderedDict()
    move_to_end = cache.move_to_end
    popitem = cache.popitem
    hit_blocks = hit_tokens = evictions = 0

    for r in range(len(lengths)):
        blocks = ids[offsets[r] : offsets[r + 1]]
        n = len(blocks)
        hit = 0
        for h in blocks:
            if h not in cache:
                break
            hit += 1
        if hit:
            hit_blocks += hit
            # Only the last block can be partial, and it is hit only when the whole request is.
            hit_tokens += lengths[r] if hit == n else hit * B
        for h in blocks:
            if h in cache:
                move_to_end(h)
            else:
                cache[h] = None
                # Evict as each block goes in (an online cache has no room to overshoot).
                if cap is not None and len(cache) > cap:
                    popitem(last=False)
                    evictions += 1

    ref_blocks = len(ids)
    ref_tokens = sum(lengths)
    return LruResult(
        requests=len(lengths),
        capacity_blocks=cap,
        hit_blocks=hit_blocks,
        ref_blocks=ref_blocks,
        hit_tokens=hit_tokens,
        ref_tokens=ref_tokens,
        block_hit_rate=hit_blocks / ref_blocks if ref_blocks else 0.0,
        token_hit_rate=hit_tokens / ref_tokens if ref_tokens else 0.0,
        evictions=evictions,
    )
