"""LRU replays of a trace in plain Python: the peers of ``kvtier simulate``.

- :func:`lru_replay` — an exact LRU prefix-cache replay with an ``OrderedDict`` and no block
  table, the way LMCache's simulator (and anyone without kvtier) would write it: the baseline
  ``kvtier bench core`` times the core's plain-LRU replay against, and the LMCache peer's hit
  rates are compared with;
- :func:`model_replay` — the same replay as ``kvtier simulate --policy lru`` (``plain-lru``,
  ``importance``), call for call, through :class:`~kvtier.reference.core.ModelCore`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypedDict

from kvtier.config import KvtierConfig
from kvtier.errors import OutOfCapacityError
from kvtier.traces import Trace

from .core import ModelCore

__all__ = ["LruResult", "lru_replay", "model_replay"]


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


def model_replay(
    trace: Trace, capacity_blocks: int, prefix_aware: bool = True, policy: str = "lru"
) -> dict[str, int | float]:
    """What ``kvtier simulate`` does for a full-precision replay of ``trace`` under ``policy``
    on a device of ``capacity_blocks`` blocks (``lru``, or ``plain-lru`` with
    ``prefix_aware=False``; ``importance`` adapts its eviction to the reuse it measures),
    through :class:`ModelCore` instead of the core: per request a sequence appends the
    request's blocks (the hits are its leading shared ones), records a read of each, plans and
    commits, and is freed. The same work as the core's replay, call for call.

    The model is the test oracle, written to be obviously right rather than fast: it scans (or,
    plain, sorts) the cached blocks at each eviction, so its time grows with the cache. Time it
    on a short trace.
    """
    config = KvtierConfig(policy=policy, prefix_aware=prefix_aware)
    m = ModelCore(
        [1],  # a byte a block: the device's budget is its capacity in blocks
        **config.core_arguments(
            [("device", capacity_blocks)], block_size=trace.block_tokens, pressure_only=True
        ),
    )
    offsets: list[int] = trace.hash_offsets.tolist()
    ids: list[int] = trace.hash_ids.tolist()
    hit_blocks = rejected = 0
    for r in range(len(trace)):
        hashes = ids[offsets[r] : offsets[r + 1]]
        seq = m.add_sequence()
        try:
            blocks, shared = m.append_blocks(seq, hashes)
            m.record_reads(blocks)
            hit_blocks += next((k for k, s in enumerate(shared) if not s), len(shared))
        except OutOfCapacityError:
            rejected += 1
            hit_blocks += len(m.lookup(hashes))
        m.commit(m.plan().id)
        m.free_sequence(seq)
    return {
        "requests": len(trace),
        "hit_blocks": hit_blocks,
        "ref_blocks": len(ids),
        "block_hit_rate": hit_blocks / len(ids) if ids else 0.0,
        "rejected": rejected,
        # Classes whose measured chance of a reuse ranks some of their blocks (importance).
        "ranked_classes": sum(any(c > 0 for c in chance) for chance in m.frequency.chance),
    }
