"""``KvtierTier``: kvtier's ladder as a secondary tier behind vLLM's own CPU offloading tier.

Under ``TieringOffloadingSpec`` vLLM moves KV between the GPU and its CPU tier (the primary),
passes every chunk that tier stores on to its secondary tiers (``submit_store``), asks them when
the primary misses (``lookup``) and promotes a hit back into primary slots (``submit_load``).
This tier keeps what it is given as kvtier's own connector keeps blocks: in a
:class:`~kvtier.BlockManager` in host memory, level 0 exact and the levels below encoded by
kvtier's codecs (``bf16,int8,int4`` keeps about three times the chunks of a plain copy in the
same bytes), ranked by kvtier's scheduler, spilling to disk and shared through a Redis server
with other engines' tiers. Load it by name in the spec's extra config::

    "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                         "host_budget": "16GiB", "ladder": "bf16,int8,int4"}]

The tier's other keys are the connector's (:func:`~.config.connector_config`: ``host_budget``,
``ladder``, ``disk_path``, ``disk_budget``, ``remote_url``, ``policy`` …), and
``attention_backend`` and ``head_dim`` where the scheduler process cannot find them
(:meth:`.offload.ChunkLayout.from_spec`).

- A chunk is a block of kvtier's named by its key's hash (:func:`.offload.chunk_hash`). A store
  job's chunks (one request's, in order) are one sequence, so the prefix trees kvtier ranks and
  evicts by (leaves first) follow the requests' chains.
- ``lookup`` answers from the manager's index: HIT only for a chunk whole and not lost. A chunk
  only the server holds is asked for on a thread (vLLM's ``AsyncLookupManager``): RETRY until
  it answers.
- Stores and loads run in order on the tier's own thread and report through
  ``get_finished_jobs``. A store copies its new chunks out of the primary slots into level 0 (a
  native copy per layer), then the manager's step demotes them down the ladder. A load decodes
  into the primary slots vLLM names; a chunk it cannot give back (evicted since the lookup,
  lost, corrupt on disk or on the server) is left out of the job's ``successful_keys`` and vLLM
  recomputes it, nothing wrong is marked loaded.
- ``drain_jobs`` waits for every job (none is cut short); ``shutdown`` drains, then closes.
- ``take_events`` tells the chunks stored and those that left (evicted, lost), when vLLM's KV
  events are on; ``cache_hit_source`` is the farthest tier the manager has.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...codecs.base import BlockShape
from ...errors import KvtierError
from ...manager import BlockManager
from .config import connector_config, staging_shares
from .offload import ChunkLayout, chunk_hash
from .tiers import WorkerTiers

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, ReqContext

__all__ = ["KvtierTier"]

log = logging.getLogger("kvtier.vllm")

#: At most this many chunks a store writes at level 0 before the step demotes them (and at
#: most a 128th of the budget's bf16 chunks: the staging levels' share stays small).
_STAGE_CHUNKS = 32
#: The hash of a chunk whose key hashes to 0 (any fixed value but 0)
_ZERO = 0x9E3779B97F4A7C15


class KvtierTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` over kvtier's tiers (see the module's docstring)."""

    medium: ClassVar[Medium | None] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        attention_backend: str | None = None,
        head_dim: int | None = None,
        locality: str | None = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # vLLM's tier key: whether the storage is the instance's own (LOCAL) or shared (REMOTE)
        self.locality = Locality(locality) if locality is not None else None
        self.layout = ChunkLayout.from_spec(
            offloading_spec, attention_backend=attention_backend, head_dim=head_dim
        )
        self.manager, self._staging = _manager(
            self.layout, config, offloading_spec.config.model.name
        )
        self.tiers = WorkerTiers(
            self.manager, self.layout.paged, self.layout.caches(primary_kv_view)
        )
        # this tier's own: its manager's tiers decide it
        self.cache_hit_source = _hit_source(self.manager)  # type: ignore[misc]
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tier")
        self._jobs: list[Future[None]] = []
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._failed_loads: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        #: chunks stored, by hash, while events are on (to name those that leave)
        self._keys: dict[int, OffloadKey] | None = None
        self._events: list[OffloadingEvent] = []
        self._events_lock = threading.Lock()
        if offloading_spec.kv_events_config.enable_kv_cache_events:
            self._keys = {}
            self.manager.core.set_index_log(True)
        sharing = self.manager.config.share_prefixes
        self._probes = _ServerProbes(self.manager, tier_type) if sharing else None
        log.info(
            "kvtier tier: chunks of %s, %d tokens, tiers %s, ladder %s",
            self.layout.name,
            self.layout.block_size,
            [t for t, _ in self.manager.core.tiers],
            ",".join(self.manager.ladder),
        )

    # -- vLLM's SecondaryTierManager -----------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.manager.lookup(block_hashes=[_hash(key)], local=True):
            return LookupResult.HIT
        if self._probes is None:
            return LookupResult.MISS
        found = self._probes.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        while not self._failed_loads.empty():  # no promotion re-issued for them (vLLM #49176)
            keys = self._failed_loads.get()
            if self._probes is not None:
                self._probes.mark_miss(keys)
        return list(_drain(self._finished))

    def has_pending_work(self) -> bool:
        self._jobs = [j for j in self._jobs if not j.done()]
        return bool(self._jobs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._keys is None:
            return ()
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._probes is not None:
            self._probes.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        if self._probes is not None:
            self._probes.flush()

    def drain_jobs(self) -> None:
        wait(self._jobs)
        self._jobs = []

    def shutdown(self) -> None:
        self.drain_jobs()
        self._thread.shutdown(wait=True)
        self.tiers.caches.clear()  # views of the primary region: it unmaps next
        if self._probes is not None:
            self._probes.shutdown()
        self.manager.close()

    # -- the jobs, on the tier's thread --------------------------------------------------------

    def _submit(self, run: Any, job: TransferJob) -> None:
        if len(job.keys) != len(job.chunk_ids):
            raise KvtierError(
                f"KvtierTier: job {job.job_id} has {len(job.keys)} keys for "
                f"{len(job.chunk_ids)} chunks"
            )
        self._jobs.append(self._thread.submit(self._report, run, job))

    def _report(self, run: Any, job: TransferJob) -> None:
        """Runs a job and reports it, whatever happens: an unexpected error fails it."""
        start = time.perf_counter()
        try:
            done: list[OffloadKey] = run(job)
        except Exception:
            log.exception("kvtier tier: job %d failed", job.job_id)
            done = []
        keys = list(job.keys)
        whole = len(done) == len(keys)
        if job.is_promotion and not whole:
            missed = set(done)
            self._failed_loads.put([k for k in keys if k not in missed])
        self._finished.put(
            JobResult(
                job_id=job.job_id,
                success=whole,
                successful_keys=None if whole or not job.is_promotion else done,
                transfer_time=time.perf_counter() - start,
                transfer_bytes=len(done) * self.layout.chunk_bytes,
            )
        )

    def _store(self, job: TransferJob) -> list[OffloadKey]:
        """Saves the job's chunks the tier lacks (runs of them, a piece of at most level 0 at a
        time, each making room for the next), then runs the manager's step (which demotes
        them). Returns the keys it holds after."""
        manager = self.manager
        keys = list(job.keys)
        hashes = np.array([_hash(k) for k in keys], dtype=np.uint64)
        ids = np.asarray(job.chunk_ids, dtype=np.int64)
        level0 = int(manager.pools["device", 0].shape[0])
        piece = max(1, level0)
        room = level0 // 2 * manager.level_bytes[0] * self._staging
        for first, end in _runs([not manager.lookup(block_hashes=[h], local=True) for h in hashes]):
            for at in range(first, end, piece):
                stop = min(at + piece, end)
                seq = manager.add_sequence(block_hashes=hashes[at:stop])
                try:
                    self.tiers.save(seq, ids[at:stop])
                finally:
                    manager.free(seq)
                self._announce(keys[at:stop], hashes[at:stop])
        manager.step(room)
        self._announce_left()
        return keys

    def _load(self, job: TransferJob) -> list[OffloadKey]:
        """Decodes the job's chunks into their primary slots, a run held together at a time (a
        run the tiers fail to give back whole is left out; chunks only the server holds come at
        most a level 0 at a time). Returns the keys loaded."""
        manager, bs = self.manager, self.layout.block_size
        piece = max(1, int(manager.pools["device", 0].shape[0]))
        keys = list(job.keys)
        hashes = np.array([_hash(k) for k in keys], dtype=np.uint64)
        ids = np.asarray(job.chunk_ids, dtype=np.int64)
        loaded: list[OffloadKey] = []
        at = 0
        while at < len(keys):
            n = min(piece, manager.lookup(block_hashes=hashes[at:]) // bs)
            if not n:
                at += 1
                continue
            seq = manager.add_sequence(block_hashes=hashes[at : at + n])
            try:
                held = manager.num_tokens(seq, manager.shape.layers - 1) // bs
                written = self.tiers.load(seq, 0, held * bs, ids[at : at + held])
                loaded += keys[at : at + written]
            except KvtierError as exc:  # a chunk lost or corrupt: the run is recomputed
                log.warning("kvtier tier: load of job %d failed (%s)", job.job_id, exc)
            finally:
                manager.free(seq)
            at += n
        self._announce_left()
        return loaded

    # -- events ---------------------------------------------------------------------------------

    def _announce(self, keys: list[OffloadKey], hashes: np.ndarray) -> None:
        if self._keys is None or not keys:
            return
        self._keys.update(zip(hashes.tolist(), keys, strict=True))
        self._event(keys, removed=False)

    def _announce_left(self) -> None:
        """Chunks that left the tiers (evicted, lost, forgotten) since the last job."""
        if self._keys is None:
            return
        hashes, tiers = self.manager.core.take_index_log()
        left = [self._keys.pop(h) for h in hashes[tiers < 0].tolist() if h in self._keys]
        if left:
            self._event(left, removed=True)

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        event = OffloadingEvent(
            keys=keys,
            medium=Medium.CPU,
            removed=removed,
            locality=self.locality,
            ownership=self.tier_type,
        )
        with self._events_lock:
            self._events.append(event)


class _ServerProbes(AsyncLookupManager):
    """Asks the server, on vLLM's lookup thread, for chunks this tier does not hold itself."""

    def __init__(self, manager: BlockManager, tier_type: str) -> None:
        self.manager = manager
        super().__init__(tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            return [bool(self.manager.lookup(block_hashes=[_hash(k)])) for k in keys]
        except KvtierError as exc:  # a server that went away: misses
            log.warning("kvtier tier: the server did not answer (%s)", exc)
            return [False] * len(keys)


def _manager(layout: ChunkLayout, extra: dict[str, Any], model: str) -> tuple[BlockManager, bool]:
    """The tier's manager: the connector's config from the tier's keys, one block a chunk, one
    layer a (worker, layer), no sinks, leaves or recent window (a chunk is a cached entry, not
    part of a chain or a running sequence), no headroom (a store makes its room by evicting), and its own staging
    shares (small: level 0 and the middle levels only pass a store's chunks down) unless the
    config has some. Beside it, whether the shares are the tier's own (then each store's step
    makes room at level 0 for the next)."""
    chunk = layout.block_size
    config = connector_config(extra, block_size=chunk)
    fixed = {
        "sink_blocks": 0,
        "keep_leaves": 0,
        "recent_window": 0,
        "evict_on_full": True,
        "headroom": 0.0,
    }
    config = config.replace(**{k: v for k, v in fixed.items() if k not in extra})
    shape = BlockShape(
        layout.workers * layout.layers,
        layout.paged.num_kv_heads,
        chunk,
        layout.paged.head_dim,
        layout.dtype,
    )
    staging = config.pool_shares is None and config.enable_compression and config.levels > 1
    if staging:
        budget = config.device_budget or 0
        stage = max(1, min(_STAGE_CHUNKS, budget // (128 * shape.fp16_bytes)))
        config = config.replace(pool_shares=staging_shares(config, shape, stage))
    namespace = f"{config.namespace}/vllm-tier/{model}/{layout.name}"
    manager = BlockManager(
        config.replace(namespace=namespace),
        shape.layers,
        shape.kv_heads,
        shape.head_dim,
        layout.dtype,
        device="cpu",
    )
    return manager, staging


def _hash(key: OffloadKey) -> int:
    """:func:`.offload.chunk_hash`, but never 0 (a manager's "no hash")."""
    return chunk_hash(key) or _ZERO


def _hit_source(manager: BlockManager) -> CacheHitSource:
    """Where hits come from, as far as one name can say: the farthest tier the manager has."""
    tiers = [t for t, _ in manager.core.tiers]
    if "remote" in tiers:
        return CacheHitSource.EXTERNAL_UNSPECIFIED
    return CacheHitSource.DISK if "disk" in tiers else CacheHitSource.HOST


def _runs(flags: list[bool]) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` of each run of True in ``flags``."""
    start = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            yield start, i
            start = None


def _drain(q: queue.SimpleQueue[JobResult]) -> Iterator[JobResult]:
    while not q.empty():
        yield q.get()
