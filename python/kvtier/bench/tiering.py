"""vLLM's native two-tier offloading, driven on this machine: its ``TieringOffloadingManager``
over a real ``SharedOffloadRegion`` (a CPU primary tier with vLLM's LRU or ARC, or kvtier's
:class:`~kvtier.integrations.vllm.KvtierCachePolicy`) and its secondary tiers (kvtier's
:class:`~kvtier.integrations.vllm.KvtierTier`, or none), called as its ``OffloadingConnector``'s
scheduler side calls it. What its GPU worker would do is done by hand: a chunk stored is
written into the primary row vLLM names, as the GPU's pages of that block (``[N, H, 2D]`` bf16
per layer, K then V in each ``2D``), and a chunk loaded is read from its row.

:class:`TwoTiers` runs one request at a time (lookups with promotions, loads, stores) and
waits for the tiers' jobs after each, so that a replay is the same every time;
:func:`replay` runs a trace through it. ``benchmarks/vllm_tiering.py`` and
``tests/test_vllm_tier.py`` use both.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..traces import Trace

__all__ = ["ChunkGeometry", "TwoTiers", "kvtier_tier", "offloading_spec", "replay"]

MODULE = "kvtier.integrations.vllm"
#: vLLM's primary-tier policies by the name a replay gives them, as ``(eviction_policy,
#: cache_policy_module_path)``.
#: Steps a request waits for its promotions and lookups before it runs without them.
_STEPS = 8
POLICIES = {"lru": ("lru", None), "arc": ("arc", None), "kvtier": ("KvtierCachePolicy", MODULE)}


@dataclass(frozen=True)
class ChunkGeometry:
    """The model KV of a chunk: ``block_size`` tokens (``blocks_per_chunk`` GPU blocks) of
    ``layers`` layers on each of ``workers`` tensor-parallel ranks, ``kv_heads`` heads of
    ``head_dim`` a rank, bf16; pages token-major (vLLM's ``LBNHC``, FlashAttention's default on
    CUDA) or head-major (``LBHNC``)."""

    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    layout: str = "LBNHC"
    workers: int = 1
    blocks_per_chunk: int = 1

    @property
    def page_bytes(self) -> int:
        """One layer's pages of a chunk on one rank."""
        return 2 * self.block_size * self.kv_heads * self.head_dim * 2

    @property
    def chunk_bytes(self) -> int:
        return self.workers * self.layers * self.page_bytes

    @property
    def row_bytes(self) -> int:
        """A primary row: the chunk, rounded up to the page size as vLLM's region rounds it."""
        return -(-self.chunk_bytes // 4096) * 4096

    @property
    def _page_shape(self) -> tuple[int, int]:
        n, h = self.block_size, self.kv_heads
        return (n, h) if self.layout == "LBNHC" else (h, n)

    def pages(self, seed: int) -> np.ndarray:
        """A chunk's pages as the GPUs hold them, ``[workers, layers, N, H, 2D]`` (``[..., H, N,
        2D]`` head-major) bf16 bits (uint16): random normal K/V, one of 64 draws, its first
        value set by ``seed`` (no two seeds below 2**16 give the same pages)."""
        pages = _draws(self)[seed % 64].copy()
        pages.flat[0] = _bf16(np.float32(1 + (seed % 65536) / 65536))
        return pages

    def kv(self, pages: np.ndarray) -> np.ndarray:
        """Pages (:meth:`pages`, or a row read back) as float32 K/V ``[workers * layers, 2, H,
        N, D]`` (the tier's layers: rank-major)."""
        x = (pages.astype(np.uint32) << 16).view(np.float32)
        x = x.reshape(self.workers * self.layers, *self._page_shape, 2, self.head_dim)
        if self.layout == "LBNHC":
            return x.transpose(0, 3, 2, 1, 4)
        return x.transpose(0, 3, 1, 2, 4)


@functools.cache
def _draws(geometry: ChunkGeometry) -> np.ndarray:
    g = geometry
    shape = (64, g.workers, g.layers, *g._page_shape, 2 * g.head_dim)
    return _bf16(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))


def _bf16(x: Any) -> Any:
    """float32 values as bf16 bits (uint16): their top halves (truncated)."""
    return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def offloading_spec(
    geometry: ChunkGeometry,
    primary_chunks: int,
    *,
    policy: str = "lru",
    tiers: Sequence[dict[str, Any]] = (),
    events: bool = False,
    model: str = "kvtier-synthetic",
) -> Any:
    """vLLM's ``TieringOffloadingSpec`` for a primary tier of ``primary_chunks`` chunks under
    ``policy`` (a key of :data:`POLICIES`) and the secondary ``tiers`` behind it (their configs:
    :func:`kvtier_tier`'s, or vLLM's own), as vLLM's connector would build it for a model of
    ``geometry``."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    g = geometry
    eviction, module = POLICIES[policy]
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": primary_chunks * geometry.row_bytes,
        "eviction_policy": eviction,
        "secondary_tiers": [dict(t) for t in tiers],
    }
    if module is not None:
        extra["cache_policy_module_path"] = module
    gpu_block = geometry.block_size // geometry.blocks_per_chunk
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(gpu_block, tuple(f"layers.{i}" for i in range(g.layers)), 0),
        ),
        worker_kv_bytes_per_block=g.layers * g.page_bytes // g.blocks_per_chunk,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"kvtier-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=gpu_block, blocks_per_chunk=g.blocks_per_chunk),
        parallel=OffloadingParallelConfig(0, g.workers, g.workers, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout=g.layout,
    )
    return TieringOffloadingSpec(config)


def kvtier_tier(geometry: ChunkGeometry, **config: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of a :class:`~kvtier.integrations.vllm.KvtierTier` for
    chunks of ``geometry`` (FlashAttention's layout: what a CUDA engine's would be), with its
    ``config`` (``host_budget``, ``ladder`` …)."""
    return {
        "type": "KvtierTier",
        "module_path": MODULE,
        "attention_backend": "FLASH_ATTN",
        "head_dim": geometry.head_dim,
        **config,
    }


@dataclass
class TwoTiers:
    """vLLM's ``TieringOffloadingManager`` of ``spec``, with the GPU worker's copies done by hand
    (see the module's docstring). ``pages(key)`` gives a chunk's pages when it is stored."""

    spec: Any
    geometry: ChunkGeometry
    pages: Callable[[bytes], np.ndarray]
    manager: Any = field(init=False)
    rows: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

        self._types = LookupResult, ReqContext, ScheduleEndContext
        self.manager = self.spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.secondary_tiers)

    def request(self, req_id: str, keys: Sequence[Any], store: bool = True) -> tuple[int, Any]:
        """One request of the chain ``keys``: looked up (a promotion from a secondary tier
        waited for, as a request waits steps), the hit prefix loaded, the rest stored. Returns
        the hit chunks and their primary rows, read as the GPU worker would, ``[hits, chunk
        bytes]``."""
        _, context_cls, step_end = self._types
        m = self.manager
        context = context_cls(req_id=req_id)
        m.on_new_request(context)
        for i, key in enumerate(keys, start=1):
            context.set_offload_key_position(key, i * self.geometry.block_size)
        counted = None
        for waited in range(_STEPS):  # a deferred lookup is asked again at a later step
            counted = self._maximal_prefix(keys, context)
            if counted is not None:
                break
            self.step(step_end((), ()))
            time.sleep(0.002 * 2**waited)  # a server's answer, on the tier's lookup thread
        hits = counted or 0
        rows = np.empty((hits, self.geometry.chunk_bytes), dtype=np.uint8)
        if hits:
            spec = m.prepare_load(keys[:hits], context)
            rows[:] = self.rows[spec.chunk_ids, : self.geometry.chunk_bytes]
            m.complete_load(keys[:hits], context)
        out = m.prepare_store(keys[hits:], context) if store and hits < len(keys) else None
        if out is not None and out.keys_to_store:
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.rows[chunk, : self.geometry.chunk_bytes] = (
                    self.pages(key).view(np.uint8).ravel()
                )
            m.complete_store(out.keys_to_store, context)
        m.on_request_finished(context)
        self.step(step_end((req_id,), ()))
        return hits, rows

    def _maximal_prefix(self, keys: Sequence[Any], context: Any) -> int | None:
        """The leading chunks of ``keys`` the tiers hold, as vLLM's connector counts them
        (``_maximal_prefix_lookup``): every key looked up until a miss, a chunk being promoted
        counted, and None (ask again next step) while any is promoted or asked for."""
        results = self._types[0]
        hits, deferred = 0, False
        for key in keys:
            found = self.manager.lookup(key, context)
            if found is results.MISS:
                break
            if found is not results.RETRY:
                hits += 1
            deferred |= found is not results.HIT
        return None if deferred else hits

    def step(self, context: Any) -> None:
        """A scheduler step's end, then the tiers' jobs waited for (so a replay is the same every
        time; a real engine polls them on its next steps)."""
        self.manager.on_schedule_end(context)
        for tier in self.tiers:
            tier.drain_jobs()

    def close(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.uint8)  # a view of the region, which unmaps
        self.manager.shutdown()


def trace_keys(trace: Trace) -> list[list[bytes]]:
    """Each request's chain of vLLM offload keys (8-byte block hashes, group 0)."""
    from vllm.v1.kv_offload.base import make_offload_key

    unique, inverse = np.unique(trace.hash_ids, return_inverse=True)
    keys_of = [make_offload_key(int(h).to_bytes(8, "big"), 0) for h in unique.tolist()]
    flat = [keys_of[k] for k in inverse.tolist()]
    offsets = trace.hash_offsets.tolist()
    return [flat[offsets[r] : offsets[r + 1]] for r in range(len(trace))]


def key_seed(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


def replay(
    trace: Trace,
    geometry: ChunkGeometry,
    primary_chunks: int,
    *,
    policy: str = "lru",
    tiers: Sequence[dict[str, Any]] = (),
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Each request's hit chunks, replaying ``trace`` through :class:`TwoTiers` of
    :func:`offloading_spec`'s, and what the secondary tier held at the end (its manager's
    ``get_compression_stats``, with ``chunks`` and ``tokens`` held), ``{}`` without one."""
    spec = offloading_spec(geometry, primary_chunks, policy=policy, tiers=tiers)
    run = TwoTiers(spec, geometry, lambda key: geometry.pages(key_seed(key)))
    hits = np.zeros(len(trace), dtype=np.int64)
    try:
        for r, keys in enumerate(trace_keys(trace)):
            hits[r] = run.request(str(r), keys)[0]
            if progress is not None and (r + 1) % 500 == 0:
                progress(r + 1)
        held: dict[str, Any] = {}
        for t in run.tiers:
            if hasattr(t, "manager"):  # a KvtierTier
                held = t.manager.get_compression_stats()
                held["chunks"] = len(t.manager.core.indexed_blocks())
                held["tokens"] = held["chunks"] * geometry.block_size
    finally:
        run.close()
    return hits, held
