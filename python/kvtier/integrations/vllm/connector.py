"""``KVTierConnector``: vLLM's connector class, a thin facade over the side of its role.

vLLM makes one connector for the scheduler and one for each worker, all of this class. Each holds
the side its role names, :class:`~.scheduler.KVTierScheduler` or :class:`~.worker.KVTierWorker`,
built from the same :class:`~.config.ConnectorSettings`, and hands each of vLLM's hooks to it;
the two sides talk only through vLLM's connector metadata and the worker's link.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...errors import KvtierError
from .config import ConnectorSettings
from .metadata import KVTierMetadata
from .metrics import KVTierPromMetrics, KVTierStats
from .scheduler import KVTierScheduler
from .worker import KVTierWorker

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .events import KVTierEvents

__all__ = ["KVTierConnector"]


class KVTierConnector(KVConnectorBase_V1):
    """vLLM's KV connector (v1 API) over kvtier's tiers: the scheduler's hooks go to
    :attr:`scheduler`, the worker's to :attr:`worker`."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_vllm(vllm_config, kv_cache_config)
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVTierScheduler(vllm_config, settings)
        else:
            self._worker = KVTierWorker(vllm_config, settings)

    @property
    def scheduler(self) -> KVTierScheduler:
        """The scheduler side (the connector vLLM made for its scheduler only)."""
        if self._scheduler is None:
            raise KvtierError("KVTierConnector: this is a worker's connector (scheduler side only)")
        return self._scheduler

    @property
    def worker(self) -> KVTierWorker:
        """The worker side (the connectors vLLM made for its workers only)."""
        if self._worker is None:
            raise KvtierError(
                "KVTierConnector: this is the scheduler's connector (worker side only)"
            )
        return self._worker

    def _metadata(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        return meta

    # -- both sides ----------------------------------------------------------------------------

    def get_compression_stats(self) -> dict[str, Any]:
        """The tiers' figures (``memory_saved_mb``, ``avg_compression_ratio``, bytes per tier
        and level: the manager's ``device`` tier is this connector's host tier) and, under
        ``connector``, what the connector did (lookups and hit tokens: the scheduler's; loaded
        and saved blocks, load errors: the worker's). On the scheduler side it asks the worker,
        and carries both sides' figures; with tensor parallelism, rank 0's figures with every
        rank's load errors and failed saves added up, and each rank's under ``ranks``. On the
        worker side, only the worker's: no ``lookups`` nor ``hit_tokens*`` (the scheduler
        looks prompts up; the worker loads what it is told, counted in ``loaded_blocks``).

        ``connector`` also splits ``hit_tokens`` (the tokens beyond vLLM's own hit that the
        scheduler's lookups found) by where the lookup found them: ``hit_tokens_by_tier``
        (``host``, ``disk``, ``remote``: the connector's tiers), ``hit_tokens_by_level`` (the
        ladder's codec names) and ``hit_tokens_by_tier_level`` (``{tier: {level: tokens}}``),
        a zero for each tier and level the tiers have that had no hit."""
        if self._worker is not None:
            return self._worker.get_compression_stats()
        return self.scheduler.get_compression_stats()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters since the last call (vLLM adds the two sides up; of the
        tensor-parallel workers, rank 0 counts the blocks for all, each rank its own failures:
        see :data:`~.metrics.FAILURES`)."""
        if self._worker is not None:
            return self._worker.get_kv_connector_stats()
        return self.scheduler.get_kv_connector_stats()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: each attention layer waits for its own load (``wait_for_layer_load``, on CUDA
        an event of the connector's stream), which a whole-model CUDA graph would skip."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self.worker.register_kv_caches(kv_caches)
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        """After a refused registration: shuts down what the worker started and, where vLLM
        installed this connector as its process's (it does so before registering the caches,
        and keeps it for every later engine of the process), uninstalls it, so that the next
        engine makes its own instead of failing with this one's error."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.shutdown()
        state = kv_transfer_state
        if state.has_kv_transfer_group() and state.get_kv_transfer_group() is self:
            state.ensure_kv_transfer_shutdown()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, as its forward pass is about to start (the worker times it)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self.worker.save_kv_layer(layer_name, self._metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVTierEvents | None:
        return self.worker.get_kv_connector_kv_cache_events()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What kvtier's tiers stored and dropped since the last call, as vLLM's KV events
        keyed by vLLM's block hashes, with the medium (``CPU``: host memory, ``STORAGE``: disk
        or the server); vLLM publishes them with its prefix cache's (``--kv-events-config``)."""
        return self.scheduler.take_events()
