"""The connector's worker side: the tiers, and the loads and saves the scheduler planned.

:class:`KVTierWorker` builds the tiers when vLLM registers its caches (a
:class:`~kvtier.BlockManager` in host memory, under a namespace of model, dtype, layout and rank,
as :class:`~.tiers.WorkerTiers` with the caches) and serves them to the scheduler over
:mod:`.link`. Each step it runs the loads of :class:`~.metadata.KVTierMetadata`: those of blocks
in host memory a layer at a time beside the forward pass (:class:`~.tiers.LayerLoads`, each attention
layer waiting for its own), the others in the background while their requests wait; after the
forward pass it saves the complete blocks, in pieces that fit level 0, scoring them with the
user's scorer if there is one. A block it cannot load is handed to vLLM as a load error (vLLM
recomputes it); a save that fails is a later miss.

State: the tiers (from registration to shutdown), this step's layer loads, background loads done
and not yet reported, the failed blocks and finished saves not yet reported, and its counters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ConfigError, KvtierError
from ...manager import BlockManager
from .config import backend_name, engine_namespace, tiers_config, tp_rank
from .link import Held, forget, serve
from .metadata import KVTierMetadata, LoadSpec, SaveSpec
from .metrics import FAILURES, CounterReports, Counters, connector_stats
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
        self._saved_finished: set[str] = set()
        self._layer_thread: Executor | None = None  # this step's loads, a layer at a time
        self._layer_loads: LayerLoads | None = None
        self._layer_index = {name: i for i, name in enumerate(settings.layer_names)}
        #: background loads done: request, blocks written, blocks failed, seconds
        self._loaded: queue.SimpleQueue[tuple[str, int, list[int], float]] = queue.SimpleQueue()
        self._background = 0  # background loads submitted and not yet reported
        self._idle = False  # this step runs no forward pass
        self._reset = False  # a reset since the last stats report

    @property
    def tiers(self) -> WorkerTiers:
        """The worker's manager, layout and caches."""
        if self._tiers is None:
            raise KvtierError("KVTierConnector: no KV caches registered (worker side only)")
        return self._tiers

    # -- what the scheduler asks (link.Link) -------------------------------------------------

    def lookup(self, tokens: list[int], salt: str | None = None) -> Held:
        """What the tiers hold of ``tokens`` (:meth:`WorkerTiers.lookup`)."""
        return self.tiers.lookup(tokens, salt)

    def stats(self) -> dict[str, Any]:
        """The tiers' figures and, under ``worker``, this side's counters."""
        stats = self.tiers.manager.get_compression_stats()
        stats["worker"] = self.counters.as_dict()
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
        self._tiers = WorkerTiers(manager, layout, caches)
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

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Starts this step's loads: background ones on their own thread (their requests wait
        for them), the others a layer at a time on the layer thread, while the forward pass
        runs (each attention layer waits for its own, in :meth:`wait_for_layer_load`)."""
        self._finish_layer_loads()  # a step whose loads no one waited for (no save pass)
        if meta.reset:
            forgotten = self.tiers.manager.clear_prefix_cache()
            self._reset = True  # the host tier's use moved
            log.info("kvtier: reset, %d stored blocks forgotten", forgotten)
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

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Saves what the step completed (every layer is computed by now)."""
        self._finish_layer_loads()
        start = time.perf_counter()
        for save in meta.saves:
            self._save(save)
        if meta.saves:
            self.tiers.manager.step()
            self.counters.save_seconds += time.perf_counter() - start
        self._saved_finished |= meta.finishing

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose last blocks are saved (vLLM may free their blocks now), and
        requests whose background load is over (they may run now). vLLM asks for load errors
        right after this: a load's failed blocks are handed over with its request."""
        saved, self._saved_finished = self._saved_finished, set()
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
        return saved or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_compression_stats(self) -> dict[str, Any]:
        """The tiers' figures with this side's counters under ``connector``."""
        return connector_stats(self.stats(), Counters())

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
        for pool in (self.loader, self._layer_thread):
            if pool is not None:
                pool.shutdown(wait=True)
        self.loader = self._layer_thread = None
        if self._tiers is not None:
            forget(self.settings.engine_id, self, self._listener, self.rank)
            self._listener = None
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

    # -- saves -------------------------------------------------------------------------------

    def _save(self, save: SaveSpec) -> None:
        """Saves what the tiers lack of the request's complete blocks so far, in pieces of at
        most half the host tier's level-0 pool: the blocks a piece writes stay at level 0
        until written, and the next piece makes room by demoting them (a long prompt, or a
        long prefill chunk, fits a level 0 kept small for capacity)."""
        bs = self.settings.block_size
        blocks = len(save.block_ids)
        piece = max(1, int(self.tiers.manager.pools["device", 0].shape[0]) // 2)
        if blocks <= piece:
            self._save_prefix(save)
            return
        held = self.tiers.manager.lookup(save.tokens, salt=save.salt) // bs
        for end in [*range(held + piece, blocks, piece), blocks]:
            tokens, block_ids = save.tokens[: end * bs], save.block_ids[:end]
            if not self._save_prefix(SaveSpec(save.req_id, save.salt, tokens, block_ids)):
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
        except KvtierError as exc:
            log.warning("kvtier: save of request %s failed (%s)", save.req_id, exc)
            self.counters.save_failures += 1
            return False
        finally:
            manager.free(seq)
        return True

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
