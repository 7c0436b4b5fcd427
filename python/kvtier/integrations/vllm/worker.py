"""The connector's worker side: the tiers, and the loads and saves the scheduler planned.

:class:`KVTierWorker` builds the tiers when vLLM registers its caches (a
:class:`~kvtier.BlockManager` in host memory, under a namespace of model, dtype, layout and rank,
as :class:`~.tiers.WorkerTiers` with the caches) and serves them to the scheduler over
:mod:`.link`. Each step it runs the loads of :class:`~.metadata.KVTierMetadata`: those of blocks
in host memory a layer at a time beside the forward pass (:class:`~.tiers.LayerLoads`, each attention
layer waiting for its own), the others in the background while their requests wait. It saves the
step's complete blocks a layer at a time as the forward pass finishes each layer (on the CPU, one
native pass out of vLLM's cache into the host tier's level 0; on a GPU, encoded there to the level
the core places them at and copied encoded, on a stream and thread of their own that the forward
pass does not wait for), scoring them with the user's scorer if there is one; a save longer than half of level 0 (its staging, beside the chains' ends) waits for the end of the forward pass and goes in
pieces there. The scheduler's step that moves the saved blocks down the ladder (their encoding) runs
on a thread of its own after vLLM's step; a save that finds level 0 full while it runs is shed
(counted), never waited for. A block it cannot load is handed to vLLM as a load error (vLLM
recomputes it); a save that fails or is shed is a later miss. When vLLM publishes KV events,
rank 0 announces the blocks its saves wrote and those its tiers dropped (:mod:`.events`). A
finished request that ended its conversation has its chain released at the next step's start,
after every save of it: the tiers evict those blocks first.

State: the tiers (from registration to shutdown), this step's layer loads and layer saves, the
saves left for the end of the forward pass, the background step, background loads done and not
yet reported, the failed blocks and finished saves not yet reported, and its counters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import ConfigError, KvtierError
from ...manager import BlockManager
from ...manager.timing import DecayedRate
from .config import backend_name, ends_room_slots, engine_namespace, tiers_config, tp_rank
from .events import KVTierEvents, TierEvents
from .link import CONNECTOR_TIERS, Held, LoadCosts, Place, forget, serve
from .metadata import KVTierMetadata, LoadSpec, ReleaseSpec, SaveSpec
from .metrics import FAILURES, LOOKUP_COUNTS, CounterReports, Counters, connector_stats
from .paged import layout_for_backend
from .tiers import LayerLoads, WorkerTiers

if TYPE_CHECKING:
    from multiprocessing.connection import Listener

    from vllm.config import VllmConfig

    from .config import ConnectorSettings
    from .metrics import KVTierStats

log = logging.getLogger("kvtier.vllm")

#: Seconds a step with no forward pass waits for a background load to end before returning:
#: short, so that requests arriving meanwhile are scheduled soon.
IDLE_WAIT_S = 0.05

__all__ = ["KVTierWorker"]


def _timing_event() -> Any:
    """A CUDA event the current stream passes now, to time what it runs until another."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


@dataclass
class _LayerSave:
    """One request's save, written a layer at a time as the forward pass finishes each."""

    spec: SaveSpec
    #: the manager sequence it writes (its prefix the tiers held shared)
    seq: int
    #: blocks the tiers held already (skipped)
    first: int
    #: the user's scores of the written blocks, one tensor per layer
    scores: list[torch.Tensor] = field(default_factory=list)
    #: blocks written at the last layer (0 until it is written)
    written: int = 0
    failed: bool = False
    #: the spec's vLLM block ids, as the layers' copies take them (converted once)
    block_ids: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.block_ids = np.asarray(self.spec.block_ids, dtype=np.int64)


class KVTierWorker:
    """The worker side of :class:`~.connector.KVTierConnector` (one per tensor-parallel rank):
    the tiers, the loads and saves of each step, and the counts of loaded and saved blocks."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._vllm_config = vllm_config
        # Checked now, before vLLM installs this connector: a refused start must leave nothing
        # behind for the next engine of the process.
        self._config = tiers_config(settings)
        #: loaded and saved blocks, load errors, failed saves
        self.counters = Counters()
        self._reports = CounterReports(self.counters)
        #: tensor-parallel rank, known once the caches are registered
        self.rank = 0
        #: the executor that runs background loads, one at a time (made on first need; one set
        #: before, such as a test's that runs them when it says, is used instead)
        self.loader: Executor | None = None
        self._tiers: WorkerTiers | None = None
        self._listener: Listener | None = None
        self._failed_blocks: set[int] = set()
        self._layer_thread: Executor | None = None  # this step's loads, a layer at a time
        self._layer_loads: LayerLoads | None = None
        self._layer_saves: list[_LayerSave] | None = None  # this step's, a layer at a time
        #: on a GPU: the stream and thread the layer saves run on, and this step's jobs there
        self._save_stream: torch.cuda.Stream | None = None
        self._save_thread: Executor | None = None
        self._save_jobs: list[Future[float]] = []
        #: this step's saves left for the end of the forward pass (None: no layer saved yet,
        #: so all of them)
        self._deferred: list[SaveSpec] | None = None
        self._stepper: Executor | None = None  # the manager's step after vLLM's
        self._step_job: Future[Any] | None = None
        self._layer_index = {name: i for i, name in enumerate(settings.layer_names)}
        #: background loads done: request, blocks written, blocks failed, seconds
        self._loaded: queue.SimpleQueue[tuple[str, int, list[int], float]] = queue.SimpleQueue()
        self._background = 0  # background loads submitted and not yet reported
        self._idle = False  # this step runs no forward pass
        self._reset = False  # a reset since the last stats report
        #: what the tiers stored and dropped, for vLLM's KV events (rank 0, with events on)
        self.events: TierEvents | None = None
        #: seconds per token of the engine's prefill steps (what a recompute costs)
        self._prefill = DecayedRate()
        #: when this step's forward pass began, the save seconds counted by then, and on a
        #: GPU an event the stream passed then
        self._step_began: tuple[float, float, Any] | None = None
        #: on a GPU: a timed step's events and tokens, read once the stream has passed both
        self._gpu_step: tuple[Any, Any, int] | None = None

    @property
    def tiers(self) -> WorkerTiers:
        """The worker's manager, layout and caches."""
        if self._tiers is None:
            raise KvtierError("KVTierConnector: no KV caches registered (worker side only)")
        return self._tiers

    # -- what the scheduler asks (link.Link) -------------------------------------------------

    def lookup(self, tokens: list[int], salt: str | None = None) -> Held:
        """What the tiers hold of ``tokens`` (:meth:`WorkerTiers.lookup`), with what loading
        and recomputing a token have cost here (:meth:`costs`)."""
        return replace(self.tiers.lookup(tokens, salt), costs=self.costs())

    def costs(self) -> LoadCosts:
        """Seconds a token has been costing to load from each place (the manager's timing of
        its loads: :meth:`~kvtier.BlockManager.load_seconds`) and to compute (this engine's
        prefill steps, timed by :meth:`begin_step` and :meth:`wait_for_save`)."""
        bs = self.tiers.layout.block_size
        load: dict[Place, float] = {}
        for (tier, level), seconds in self.tiers.manager.load_seconds().items():
            place = (CONNECTOR_TIERS[tier], level)  # the manager's device tier is host memory
            load[place] = max(load.get(place, 0.0), seconds / bs)
        return LoadCosts(tuple((t, lv, s) for (t, lv), s in load.items()), self._prefill.rate)

    def stats(self) -> dict[str, Any]:
        """The tiers' figures (once the background step is over) and, under ``worker``, this
        side's counters (not :data:`~.metrics.LOOKUP_COUNTS`: the scheduler's)."""
        self._settle()
        stats = self.tiers.manager.get_compression_stats()
        stats["worker"] = self.counters.as_dict(without=LOOKUP_COUNTS)
        costs = self.costs()
        load: dict[str, dict[str, float]] = {}
        for tier, level, seconds in costs.load:
            load.setdefault(tier, {})[level] = seconds
        stats["seconds_per_token"] = {"recompute": costs.recompute, "load": load}
        return stats

    # -- vLLM's worker-side hooks ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        settings = self.settings
        names = list(settings.layer_names)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KVTierConnector: no KV cache registered for layers {missing}")
        caches = [kv_caches[n] for n in names]
        backend = backend_name(self._vllm_config, names[0])
        spec = settings.spec
        layouts = {
            layout_for_backend(
                backend,
                c,
                num_kv_heads=spec.num_kv_heads,
                block_size=settings.block_size,
                head_dim=spec.head_size,
            )
            for c in caches
        }
        if len(layouts) != 1:
            raise ConfigError(
                f"KVTierConnector: layers differ in layout: {sorted(x.name for x in layouts)}"
            )
        layout = layouts.pop()
        # Each tensor-parallel rank keeps its own heads' shard under a namespace of its own.
        self.rank = tp_rank(self._vllm_config)
        namespace = engine_namespace(self._vllm_config, spec, settings.config.namespace, self.rank)
        config = self._config.replace(namespace=f"{namespace}/{layout.name}")
        if settings.tp_size > 1 and config.disk_path is not None:  # a directory per rank
            config = config.replace(disk_path=os.path.join(config.disk_path, f"tp{self.rank}"))
        manager = BlockManager(
            config,
            num_layers=len(caches),
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            dtype=caches[0].dtype,
            device="cpu",
        )
        # On a GPU, saves encode there and move encoded bytes, on a thread and stream of
        # their own; on the CPU, one native copy into level 0 (the tiers' step encodes).
        cuda = caches[0].device.type == "cuda"
        self._tiers = WorkerTiers(manager, layout, caches, encode=cuda)
        if cuda:
            self._save_stream = torch.cuda.Stream(caches[0].device)  # type: ignore[no-untyped-call]
        kv_events = self._vllm_config.kv_events_config
        if kv_events is not None and kv_events.enable_kv_cache_events and self.rank == 0:
            self.events = TierEvents(manager.core, settings.block_size)
        try:
            self._listener = serve(settings.engine_id, self, self.rank)
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "kvtier: %d layers, layout %s, tiers %s, ladder %s",
            len(caches),
            layout.name,
            [t for t, _ in manager.core.tiers],
            ",".join(manager.ladder),
        )

    def begin_step(self) -> None:
        """vLLM bound a step's metadata: its forward pass starts now (on a GPU, once what the
        stream holds has run: an event, read a step later)."""
        if self._gpu_step is not None and self._gpu_step[1].query():
            start, end, tokens = self._gpu_step
            self._prefill.add(start.elapsed_time(end) / 1000, tokens)
            self._gpu_step = None
        cuda = self._tiers is not None and self._tiers.caches[0].device.type == "cuda"
        event = _timing_event() if cuda else None
        self._step_began = (time.perf_counter(), self.counters.save_seconds, event)

    def _time_prefill(self, meta: KVTierMetadata) -> None:
        """Takes the forward pass that just ended as what computing its tokens costs (on the
        CPU, less the saves within it; on a GPU, the stream's time). Not timed: a step with
        loads (its attention may wait for them, and they compete for the CPU), nor one of
        fewer tokens than a block (decode steps, whose fixed costs dwarf a token's: a prompt's
        block is what a load saves)."""
        began, self._step_began = self._step_began, None
        if began is None or meta.loads or meta.tokens < self.settings.block_size:
            return
        start, saving, event = began
        if event is None:
            seconds = time.perf_counter() - start - (self.counters.save_seconds - saving)
            self._prefill.add(seconds, meta.tokens)
        elif self._gpu_step is None:
            self._gpu_step = (event, _timing_event(), meta.tokens)

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Releases the chains of requests that ended their conversations, then starts this
        step's loads: background ones on their own thread (their requests wait for them), the
        others a layer at a time on the layer thread, while the forward pass runs (each
        attention layer waits for its own, in :meth:`wait_for_layer_load`)."""
        self._finish_layer_loads()  # a step whose loads no one waited for (no save pass)
        if meta.reset:
            forgotten = self.tiers.manager.clear_prefix_cache()
            self._reset = True  # the host tier's use moved
            log.info("kvtier: reset, %d stored blocks forgotten", forgotten)
        for release in meta.releases:
            self._release(release)
        self._idle = meta.idle
        now = []
        for load in meta.loads:
            if load.background:
                self.loader = self.loader or ThreadPoolExecutor(1, "kvtier-load")
                self.loader.submit(self._load_in_background, load)
                self._background += 1
            else:
                now.append(load)
        if now:
            self._layer_thread = self._layer_thread or ThreadPoolExecutor(1, "kvtier-layers")
            self._layer_loads = LayerLoads(self.tiers, now, self._layer_thread)

    def wait_for_layer_load(self, layer_name: str) -> None:
        loads, layer = self._layer_loads, self._layer_index.get(layer_name)
        if loads is not None and layer is not None:
            loads.wait(layer)

    def save_kv_layer(self, layer_name: str, meta: KVTierMetadata) -> None:
        """Saves layer ``layer_name`` of the step's complete blocks, which the forward pass has
        just computed, while it goes on with the next layer: on the CPU, one native read of
        their blocks out of vLLM's cache each, appended whole to the host tier's level 0; on a
        GPU, queued on the save thread, where the save stream waits for this layer and encodes
        its blocks there (:meth:`~.tiers.WorkerTiers.save_layer`). The first layer starts the
        step's saves (:meth:`_begin_layer_saves`), the last one (on a GPU,
        :meth:`wait_for_save`) ends them."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves:
            return
        start = time.perf_counter()
        if layer == 0:
            self._end_layer_saves()  # a forward pass that never reached its last layer
            self._layer_saves = self._begin_layer_saves(meta.saves)
        last = layer == len(self._layer_index) - 1
        saves = self._layer_saves or []
        if self._save_stream is None:
            self._save_layers(saves, layer, last)
        else:  # after what the forward pass queued so far, beside what it queues next
            event = torch.cuda.current_stream().record_event()
            self._save_thread = self._save_thread or ThreadPoolExecutor(1, "kvtier-save")
            self._save_jobs.append(
                self._save_thread.submit(self._save_layers, saves, layer, last, event)
            )
        if last and self._save_stream is None:
            self._end_layer_saves()
        self.counters.save_seconds += time.perf_counter() - start

    def _save_layers(
        self, saves: list[_LayerSave], layer: int, last: bool, after: Any = None
    ) -> float:
        """One layer of the step's layer saves; on a GPU (``after``: the forward pass's event
        for it), on the save stream, on the save thread. Returns the seconds it took."""
        start = time.perf_counter()
        stream = self._save_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_event(after)
            for save in saves:
                if not save.failed:
                    self._save_layer(save, layer, last)
        return time.perf_counter() - start

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Runs the saves the layers did not (all of them if no layer saved: a forward pass
        without vLLM's attention hooks; else those longer than half of level 0), then hands the
        manager's step, which moves the saved blocks down the ladder, to a thread of its own."""
        self._time_prefill(meta)
        self._finish_layer_loads()
        self._end_layer_saves()
        start = time.perf_counter()
        deferred = meta.saves if self._deferred is None else self._deferred
        self._deferred = None
        for save in deferred:
            self._save(save)
        if meta.saves:
            self._step_later()
        self.counters.save_seconds += time.perf_counter() - start

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background load is over (they may run now); never a finished request
        (its saves end within the steps that plan them: vLLM frees its blocks at once). vLLM
        asks for load errors right after this: a load's failed blocks are handed over with its
        request."""
        done = []
        if self._idle and self._background and self._loaded.empty():
            # Nothing else to do: vLLM's loop would call again at once, and take the GIL from
            # the loads in turns of 5 ms (measured: a pass loading 14 blocks from disk took
            # 4-10 s that way, under 1 s waiting here). Wait a moment for one to end.
            with contextlib.suppress(queue.Empty):
                done.append(self._loaded.get(timeout=IDLE_WAIT_S))
        while not self._loaded.empty():
            done.append(self._loaded.get())
        loaded: set[str] = set()
        for req_id, ok, failed, seconds in done:
            loaded.add(req_id)
            self._count_load(ok, failed, seconds)
        self._background -= len(done)
        return None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_compression_stats(self) -> dict[str, Any]:
        """The tiers' figures with this side's counters under ``connector``: the blocks it
        loaded and saved, their bytes and seconds, load errors, failed and shed saves. Not the
        lookups and hit tokens (``lookups``, ``hit_tokens``, ``hit_tokens_by_tier``, ...): the
        scheduler looks prompts up and counts what they found where, and the worker only loads
        what the scheduler admitted (counted in ``loaded_blocks``); a worker figure under those
        names would be zeros that read as "nothing hit". The scheduler-side connector's
        figures carry both sides'."""
        return connector_stats(self.stats(), None)

    def get_kv_connector_kv_cache_events(self) -> KVTierEvents | None:
        """What the tiers stored and dropped since the last call, as vLLM's KV events (rank
        0's, when vLLM publishes them; a drop the background step makes after this step's
        call is in the next step's)."""
        return None if self.events is None else self.events.take()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """This side's counters since the last call (vLLM adds up its workers'): of the
        tensor-parallel workers, rank 0 counts blocks for all, each its own :data:`FAILURES`;
        rank 0 adds the host tier's :data:`GAUGES` when a save, load or reset may have moved
        them."""
        report = self._reports.take(None if self.rank == 0 else FAILURES)
        if self.rank == 0 and self._tiers is not None and (report is not None or self._reset):
            self._reset = False
            report = report or self._reports.empty()
            report.data.update(self._host_use())
        return report

    def _host_use(self) -> dict[str, int]:
        """:data:`GAUGES`: rank 0's host tier times the ranks (each holds its heads' shard of
        the same blocks)."""
        pools = [p for p in self.tiers.manager.stats().pools if p.tier == "device"]
        ranks = self.settings.tp_size
        return {
            "host_held_bytes": ranks * sum(p.bytes for p in pools),
            "host_capacity_bytes": ranks * sum(p.capacity_bytes for p in pools),
        }

    def shutdown(self) -> None:
        self._finish_layer_loads()
        if self._tiers is not None:
            self._end_layer_saves()
        self._settle()
        for pool in (self.loader, self._layer_thread, self._stepper, self._save_thread):
            if pool is not None:
                pool.shutdown(wait=True)
        self.loader = self._layer_thread = self._stepper = self._save_thread = None
        if self._tiers is not None:
            forget(self.settings.engine_id, self, self._listener, self.rank)
            self._listener = None
            if self.events is not None:
                self.events.close()
                self.events = None
            self._tiers.manager.close()
            self._tiers = None

    # -- loads -------------------------------------------------------------------------------

    def _finish_layer_loads(self) -> None:
        """Waits for this step's layer-wise loads (every layer is in by now, unless vLLM ran
        no forward pass) and hands their failed blocks to vLLM."""
        if self._layer_loads is not None:
            results = self._layer_loads.finish()
            for ok, failed in results:
                self._count_load(ok, failed)
            self.counters.load_seconds += self._layer_loads.seconds
            self._layer_loads = None

    def _load_in_background(self, load: LoadSpec) -> None:
        start = time.perf_counter()
        try:
            ok, failed = self._load(load)
        except BaseException:  # never leave the request waiting: a failed load is recomputed
            log.exception("kvtier: background load of request %s failed", load.req_id)
            ok, failed = 0, load.block_ids
        self._loaded.put((load.req_id, ok, failed, time.perf_counter() - start))

    def _count_load(self, ok: int, failed: list[int], seconds: float = 0.0) -> None:
        self._failed_blocks.update(failed)
        self.counters.loaded_blocks += ok
        self.counters.loaded_bytes += ok * self.tiers.manager.level_bytes[0]
        self.counters.load_errors += len(failed)
        self.counters.load_seconds += seconds

    def _load(self, load: LoadSpec) -> tuple[int, list[int]]:
        """Writes what the tiers give back into ``load.block_ids``: how many it wrote, and the
        blocks it could not (vLLM's load errors, which it recomputes)."""
        tiers = self.tiers
        manager = tiers.manager
        ok = 0  # blocks of load.block_ids written
        try:
            seq = manager.add_sequence(load.tokens, salt=load.salt)
        except KvtierError as exc:
            log.warning("kvtier: load of request %s failed (%s); recomputing", load.req_id, exc)
        else:
            try:
                ok = tiers.load(seq, load.start, len(load.tokens), load.block_ids)
            except KvtierError as exc:  # a block lost in the tiers: vLLM recomputes them all
                log.warning("kvtier: load of request %s failed (%s); recomputing", load.req_id, exc)
                ok = 0
            finally:
                manager.free(seq)
        return ok, load.block_ids[ok:]

    def _release(self, release: ReleaseSpec) -> None:
        """Releases what the tiers hold of a finished request's tokens (its saves all ran in
        the steps before): evicted first, unless a later request shares them again."""
        try:
            tokens = self.tiers.manager.release_cached(release.tokens, salt=release.salt)
        except KvtierError as exc:  # a hint: failing it costs a later eviction order only
            log.warning("kvtier: release of request %s failed (%s)", release.req_id, exc)
            return
        self.counters.released_blocks += tokens // self.settings.block_size

    # -- saves -------------------------------------------------------------------------------

    def _begin_layer_saves(self, saves: list[SaveSpec]) -> list[_LayerSave]:
        """A manager sequence for each save the layers can write: at most half of the host
        tier's level 0 of new blocks for all of them (where they stay, pinned, until their last
        layer is written; the others wait for the end of the forward pass and go in pieces,
        :meth:`_save`). Room for them is made as an append makes it, unless the tiers' step,
        which makes it, is still running on its thread: then a save is cut to the free slots
        and the rest shed (counted: a later miss) rather than waited for (unless
        ``shed_saves`` is off: then it waits for that step)."""
        manager = self.tiers.manager
        bs = self.settings.block_size
        # What the layer saves of a step may pin at level 0 at once, in all.
        piece = max(1, self._stage_slots() // 2)
        free, busy = self._level0_free(), self._stepping()
        layer_saves: list[_LayerSave] = []
        self._deferred = []
        for spec in saves:
            held = len(manager.core.lookup_tokens(spec.tokens, spec.salt))
            new = len(spec.block_ids) - held
            if new <= 0:
                continue
            if new > piece:
                self._deferred.append(spec)
                continue
            if busy and new > free and not self.settings.shed_saves:
                self._settle()
                busy = False
            if busy and new > free:
                self.counters.shed_blocks += new - free
                if not free:
                    continue
                spec = spec.head(held + free, bs)  # the blocks that fit, from the first lacking
                new = free
            try:
                seq = manager.add_sequence(spec.tokens, salt=spec.salt)
            except KvtierError as exc:  # a save that fails is a future miss, nothing worse
                log.warning("kvtier: save of request %s failed (%s)", spec.req_id, exc)
                self.counters.save_failures += 1
                continue
            free, piece = max(0, free - new), piece - new
            layer_saves.append(_LayerSave(spec, seq, manager.num_tokens(seq) // bs))
        return layer_saves

    def _save_layer(self, save: _LayerSave, layer: int, last: bool) -> None:
        """One layer of a layer save; a failure ends it (its sequence is freed at the end)."""
        on_keys = None
        if self.settings.scorer is not None:

            def on_keys(layer: int, keys: torch.Tensor) -> None:
                save.scores.append(self._score(save.spec.req_id, layer, keys))

        try:
            written = self.tiers.save_layer(layer, save.seq, save.block_ids, on_keys)
        except KvtierError as exc:
            log.warning("kvtier: save of request %s failed (%s)", save.spec.req_id, exc)
            self.counters.save_failures += 1
            save.failed = True
            return
        if last:
            save.written = written

    def _end_layer_saves(self) -> None:
        """Waits for the layer saves still running (on a GPU), counts those whose last layer
        is written, gives them the user's scores, and frees their sequences (blocks some layer
        never finished are forgotten)."""
        jobs, self._save_jobs = self._save_jobs, []
        for job in jobs:
            try:
                self.counters.save_seconds += job.result()
            except Exception:  # _save_layer ends a failing save itself: not expected
                log.exception("kvtier: a layer save failed")
        saves, self._layer_saves = self._layer_saves, None
        if not saves:
            return
        manager = self.tiers.manager
        for save in saves:
            try:
                if save.written and not save.failed:
                    self.counters.saved_blocks += save.written
                    self.counters.saved_bytes += save.written * manager.level_bytes[0]
                    scores = save.scores
                    if scores and all(len(x) == save.written for x in scores):
                        mean = torch.stack(scores).mean(0).numpy()  # over the layers
                        manager.set_learned_scores(save.seq, mean, save.first)
                    self._announce(save.spec, save.seq, save.first, save.written)
            except KvtierError as exc:
                log.warning("kvtier: save of request %s failed (%s)", save.spec.req_id, exc)
            finally:
                manager.free(save.seq)

    def _staging(self) -> bool:
        """Whether the tiers' levels are the connector's own staging shares."""
        return self.settings.config.pool_shares is None and len(self.tiers.manager.ladder) > 1

    def _stage_slots(self) -> int:
        """The host tier's level-0 slots for saves (pinned there until written, then moved
        down): all of them but, under the connector's own shares, the room of the chains'
        ends where they settle at level 0, which a save's room must not take from them."""
        manager = self.tiers.manager
        slots = int(manager.pools["device", 0].shape[0])
        if self._staging() and manager.core.ends_level == 0:
            slots -= ends_room_slots(manager.config, manager.level_bytes[0])
        return max(1, slots)

    def _level0_free(self) -> int:
        """Free slots of the host tier's level 0 now."""
        for tier, level, used, capacity, *_ in self.tiers.manager.core.usage():
            if tier == "device" and level == 0:
                return int(capacity) - int(used)
        return 0

    def _stepping(self) -> bool:
        """Whether the background step is still running."""
        return self._step_job is not None and not self._step_job.done()

    def _step_later(self) -> None:
        """The manager's step on the stepper thread, unless one is running (the next covers
        what it does not). Under the connector's own staging shares it also makes room at
        level 0 for the next step's saves (half of its staging slots: a step's blocks, see
        :func:`~.config.staging_shares`); under the user's, the next save makes its own."""
        if self._stepping():
            return
        self._settle()
        manager = self.tiers.manager
        room = self._stage_slots() // 2 * manager.level_bytes[0] if self._staging() else 0
        self._stepper = self._stepper or ThreadPoolExecutor(1, "kvtier-step")
        self._step_job = self._stepper.submit(manager.step, room)

    def _settle(self) -> None:
        """Waits for the background step; logs its failure (its plan was aborted: every block
        stayed where it was)."""
        job, self._step_job = self._step_job, None
        if job is not None:
            try:
                job.result()
            except Exception:
                log.exception("kvtier: the tiers' step after a save failed")

    def _save(self, save: SaveSpec) -> None:
        """Saves what the tiers lack of the request's complete blocks so far, in pieces of at
        most the host tier's level-0 staging (this runs once the step's layer saves are done and
        before its background step): the blocks a piece writes stay at level 0 until written,
        and the next piece makes room by demoting them (a long prompt, or a long prefill
        chunk, fits a level 0 kept small for capacity)."""
        bs = self.settings.block_size
        blocks = len(save.block_ids)
        piece = self._stage_slots()
        if blocks <= piece:
            self._save_prefix(save)
            return
        held = self.tiers.manager.lookup(save.tokens, salt=save.salt) // bs
        for end in [*range(held + piece, blocks, piece), blocks]:
            if not self._save_prefix(save.head(end, bs)):
                return

    def _save_prefix(self, save: SaveSpec) -> bool:
        """Saves the blocks of ``save`` the tiers lack: a sequence of them shares the prefix
        the tiers hold, the rest is read from vLLM's blocks (all computed by now), and it is
        freed at once, leaving its blocks cached. False if the save failed."""
        tiers = self.tiers
        manager = tiers.manager
        try:
            seq = manager.add_sequence(save.tokens, salt=save.salt)
        except KvtierError as exc:  # a save that fails is a future miss, nothing worse
            log.warning("kvtier: save of request %s failed (%s)", save.req_id, exc)
            self.counters.save_failures += 1
            return False
        first = manager.num_tokens(seq) // self.settings.block_size  # blocks held already
        scores: list[torch.Tensor] = []

        def score(layer: int, keys: torch.Tensor) -> None:
            scores.append(self._score(save.req_id, layer, keys))

        on_keys = None if self.settings.scorer is None else score
        try:
            saved = tiers.save(seq, save.block_ids, on_keys)
            self.counters.saved_blocks += saved
            self.counters.saved_bytes += saved * manager.level_bytes[0]
            if scores and all(len(x) == saved for x in scores):  # mean over the layers
                manager.set_learned_scores(seq, torch.stack(scores).mean(0).numpy(), first)
            self._announce(save, seq, first, saved)
        except KvtierError as exc:
            log.warning("kvtier: save of request %s failed (%s)", save.req_id, exc)
            self.counters.save_failures += 1
            return False
        finally:
            manager.free(seq)
        return True

    def _announce(self, save: SaveSpec, seq: int, first: int, written: int) -> None:
        """Announces (vLLM's KV events) the ``written`` blocks a save wrote after the ``first``
        its sequence ``seq`` shared, while the sequence still holds them (none can have left
        the tiers yet)."""
        if self.events is None or save.keys is None or not written:
            return
        blocks = self.tiers.manager.core.sequence_blocks(seq)[first : first + written]
        self.events.stored(save.keys, save.tokens, blocks, first)

    def _score(self, req_id: str, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """The user's scorer on one layer's keys of the blocks saved; a failing scorer leaves
        them unscored (the other signals rank them)."""
        scorer = self.settings.scorer
        assert scorer is not None
        try:
            scores = torch.as_tensor(scorer(layer, keys), dtype=torch.float32)
            scores = scores.reshape(-1).cpu()
            if len(scores) != len(keys) or not bool((torch.isfinite(scores) & (scores >= 0)).all()):
                raise ValueError(
                    f"expected {len(keys)} finite non-negative scores, got {scores.tolist()}"
                )
        except Exception as exc:
            log.warning("kvtier: scorer failed on request %s, layer %d: %s", req_id, layer, exc)
            return torch.empty(0)
        return scores
