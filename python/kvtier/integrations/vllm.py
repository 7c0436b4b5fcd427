"""``KVTierConnector``: vLLM's KV kept in kvtier's compressed tiers behind vLLM's own pool.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_budget": "8GiB", "ladder": "bf16,int8,int4"}}'

vLLM's paged pool stays vLLM's. Each prompt block vLLM computes is saved, after the step that
completed it, into a :class:`~kvtier.BlockManager` that lives in host memory (its ``device``
tier is this connector's *host* tier), optionally backed by a disk directory and a Redis server.
There the Rust core ranks blocks and demotes cold ones down the ladder (bf16 → int8 → int4) and
out to disk, and promotes them back when they are hit. A later request whose prompt starts with
saved blocks loads them into the blocks vLLM allocated for it instead of recomputing them.

- **Keys** are prefix hashes of token ids in a namespace of model, dtype, layout, block size
  and parallel rank, so a change of any of them misses rather than loads foreign bytes. With
  ``remote_url`` the complete prompt blocks are also published to the server at level 0 under
  those keys (``share_prefixes``), where another engine of the same namespace, or this one after
  a restart, finds them; a prefill engine (``kv_producer``) hands its KV to a decode engine
  (``kv_consumer``) that way.
- **Loads** of blocks in host memory run within the step, a layer at a time beside the
  forward pass (each attention layer waits for its own: ``wait_for_layer_load``). A hit that
  reaches disk or the server loads in the worker's background while the request waits and
  the others run (vLLM's async load; ``"async_loads"``: ``auto``, ``always``, ``never``).
  A block the tiers cannot give back (a corrupt value, an evicted one, a server that went
  away) is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes it: a miss, never wrong K/V (the
  connector sets vLLM's ``kv_load_failure_policy`` to ``recompute`` unless
  ``kv_connector_extra_config`` says ``"load_failure_policy": "fail"``).
- **Importance**: key magnitude at save time, access frequency from hits and, with
  ``"scorer": "package.module:function"``, a learned score of each saved block's keys (see
  :func:`_import_scorer`); vLLM exposes no attention weights to connectors, so that signal's
  weight is renormalised away.

The tiers live with the worker; the scheduler asks them how much of a prompt they hold, directly
when both share a process, else over the worker's Unix socket (:mod:`.worker_link`).

Supported: decoder-only models with full attention in one KV-cache group, tensor parallelism
(each rank keeps its own heads' shard in tiers of its own: a namespace and a disk directory per
rank; a prompt loads as far as every rank holds it). Refused with a clear error: hybrid and
sliding-window models, MLA, pipeline parallelism.
A request's ``cache_salt`` seeds its blocks' hashes: requests share stored blocks (here, on
disk, on the server) only with requests of the same salt.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from .._torch import dtype_name
from ..codecs import get_codec
from ..codecs.base import BlockShape
from ..config import ENV_VARS, KvtierConfig, parse_bytes
from ..errors import ConfigError, KvtierError, require
from ..manager import BlockManager
from .paged import layout_for_backend, load_blocks, load_layer, loadable_blocks, save_blocks
from .worker_link import (
    CONNECTOR_TIERS,
    Counters,
    Held,
    Link,
    Place,
    WorkerTiers,
    forget,
    link_to_worker,
    serve,
)

require("vllm", "vllm", purpose="kvtier.integrations.vllm plugs into vLLM")
import torch  # noqa: E402  (vLLM brings torch)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")

__all__ = [
    "HIT_SOURCES",
    "KVTierConnector",
    "KVTierMetadata",
    "KVTierStats",
    "connector_config",
    "hit_sources",
    "staging_shares",
]

#: Of the host budget, at most this fraction stages saves at the levels above the bottom.
MAX_STAGING_SHARE = 0.25
#: The host tier's budget when the extra config names none.
DEFAULT_HOST_BUDGET = "2GiB"
#: Keys of ``kv_connector_extra_config`` that are the connector's own, not KvtierConfig fields.
CONNECTOR_KEYS = frozenset({"load_failure_policy", "async_loads", "scorer"})
#: ``async_loads``: when a hit loads in the worker's background while the request waits.
ASYNC_LOADS = ("auto", "always", "never")
_VARS = {var.field: var for var in ENV_VARS}
#: vLLM's label (``vllm:prompt_tokens_cached_by_source``) for hits in each of the connector's
#: tiers. The server is a store that engines share, not another vLLM instance handing its KV
#: over (vLLM's ``p2p``): vLLM files a remote store under ``external_unspecified``.
HIT_SOURCES = {
    "host": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
}
#: KvtierConfig fields vLLM decides, not the user.
VLLM_OWNED = {
    "block_size": "vLLM's block size (--block-size)",
    "device_budget": "vLLM's own KV pool (--gpu-memory-utilization); use host_budget",
    "device_blocks": "vLLM's own KV pool (--num-gpu-blocks-override); use host_blocks",
}


def connector_config(
    extra: Mapping[str, Any], *, block_size: int, environ: Mapping[str, str] | None = None
) -> KvtierConfig:
    """The :class:`KvtierConfig` of the connector's tiers from ``kv_connector_extra_config``
    (KvtierConfig field names; sizes as ``"64GiB"``; lists as ``"bf16,int8,int4"`` or JSON
    lists) over ``KVTIER_*`` and the original ``VLLM_*`` variables. ``host_budget`` (default
    2 GiB) becomes the manager's device budget: the manager lives in host memory.

    ``pool_shares``, when neither the extra config nor ``KVTIER_POOL_SHARES`` gives it and the
    ladder has several levels, stays unset here: the worker sizes it once it knows the bytes of
    a block (:func:`staging_shares`)."""
    extra = {k: v for k, v in extra.items() if k not in CONNECTOR_KEYS}
    for name, owner in VLLM_OWNED.items():
        if extra.get(name) is not None:
            raise ConfigError(f"kv_connector_extra_config: {name} is set by {owner}")
    # A string value reads as its KVTIER_* variable would ("64GiB", "bf16,int8,int4",
    # "0.5,0.2,0.3", "true"); JSON numbers, lists and booleans pass as they are.
    overrides: dict[str, Any] = {}
    for name, value in extra.items():
        var = _VARS.get(name)
        if isinstance(value, str) and var is not None:
            try:
                value = var.parse(value)
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"kv_connector_extra_config: {name}: {exc}") from None
        elif isinstance(value, list):
            value = tuple(value)
        overrides[name] = value
    env = KvtierConfig.from_env(environ=environ, **overrides)
    host = env.host_budget
    if host is None and env.host_blocks is None:
        host = parse_bytes(DEFAULT_HOST_BUDGET)
    remote = env.remote_budget
    if env.remote_url is not None and remote is None:
        remote = 4 * (host or 0) or parse_bytes(DEFAULT_HOST_BUDGET)
    if env.ladder is not None and env.ladder[-1] == "drop":
        raise ConfigError(
            "ladder: the connector's tiers are a prefix cache behind vLLM's own pool, whose "
            "attention kvtier does not run: a block leaves it by eviction, so a 'drop' level "
            f"has no meaning there; remove it from {','.join(env.ladder)}"
        )
    return env.replace(
        block_size=block_size,
        device_budget=host,
        device_blocks=env.host_blocks,
        host_budget=None,
        host_blocks=None,
        remote_budget=remote,
        share_prefixes=env.remote_url is not None,
    )


def staging_shares(config: KvtierConfig, shape: BlockShape, stage_blocks: int) -> tuple[float, ...]:
    """The connector's own ``pool_shares`` for blocks of ``shape``: ``stage_blocks`` slots (the
    blocks one step of vLLM may complete: ``max_num_batched_tokens`` over the block size) at
    level 0 and at each middle level, at most a quarter of the budget and at least one slot
    each, and the rest of the budget at the bottom level.

    vLLM's own pool holds the hot blocks at full precision; behind it the connector is
    capacity. A save lands at level 0 (pinned there until written), and each step demotes it
    as deep as a free slot is (the bottom level making room by evicting its lowest-ranked
    leaf), so the levels above the bottom only stage what a step passes on: sized to one step,
    they leave the rest of the bytes to the bottom level (``int4`` holds a block in 0.31 of its
    bf16 bytes). A save larger than half of level 0 goes in pieces, each making room for the
    next, so a long prefill chunk still fits."""
    ladder = config.resolved_ladder(shape.dtype)
    level_bytes = [get_codec(name).bytes_per_block(shape) for name in ladder]
    budget = config.device_budget
    if budget is None:
        assert config.device_blocks is not None, "connector_config sets one of the two"
        budget = config.device_blocks * level_bytes[0]
    affordable = int(MAX_STAGING_SHARE * budget) // sum(level_bytes[:-1])
    stage = max(1, min(stage_blocks, affordable))
    # Half a byte more than the slots take: the manager's floor of share * budget / bytes
    # must not lose one to rounding.
    above = [(stage * b + 0.5) / budget for b in level_bytes[:-1]]
    return (*above, 1.0 - sum(above))


# -- what the scheduler tells the worker each step ---------------------------------------------


@dataclass
class LoadSpec:
    """Copy the K/V of ``tokens[start:]`` (whole blocks, which the tiers held at lookup) into
    vLLM blocks ``block_ids`` (one per ``block_size`` tokens)."""

    req_id: str
    salt: str | None  # the request's cache_salt
    tokens: list[int]
    start: int
    block_ids: list[int]
    #: in the worker's background, the request waiting meanwhile (vLLM's async load)
    background: bool = False


@dataclass
class SaveSpec:
    """Save the K/V of ``tokens`` (complete blocks, all of them computed by now) that the
    manager lacks, reading vLLM blocks ``block_ids``."""

    req_id: str
    salt: str | None
    tokens: list[int]
    block_ids: list[int]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: finished requests whose blocks vLLM keeps until their save is done (get_finished)
    finishing: set[str] = field(default_factory=set)


def hit_sources(places: Mapping[Place, int], tokens: int) -> dict[CacheHitSource, int]:
    """``tokens`` hit tokens by vLLM's source label, from where they lie (``places``: tokens by
    tier and level); any ``places`` does not account for are ``external_unspecified``, so that
    the counts add up to ``tokens`` as vLLM requires. Only non-zero counts."""
    sources: dict[CacheHitSource, int] = {}
    for (tier, _), n in places.items():
        source = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
        sources[source] = sources.get(source, 0) + n
    rest = tokens - sum(sources.values())
    if rest:
        unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED
        sources[unspecified] = sources.get(unspecified, 0) + rest
    return {source: n for source, n in sources.items() if n}


@dataclass
class _Hit:
    """What the tiers can load of a waiting request's prompt: ``tokens[start:end]``."""

    start: int  # vLLM's own hit
    end: int
    background: bool
    held: Held  # where the lookup found the prompt's blocks


@dataclass
class _Request:
    """The scheduler's view of a running request."""

    salt: str | None
    tokens: list[int]
    block_ids: list[int]
    saved: int = 0  # prompt tokens sent to the worker for saving


@dataclass
class KVTierStats(KVConnectorStats):
    """The connector's counters over an interval (``Counters`` fields), for vLLM's logs
    ("KV Transfer metrics: ...") and its Prometheus endpoint (``vllm:kvtier_*_total``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvtier_{name}": value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        helps = {
            "lookups": "Prompts looked up in kvtier's tiers.",
            "hit_tokens": "Prompt tokens kvtier's tiers could load.",
            "loaded_blocks": "Blocks loaded from kvtier's tiers into vLLM's.",
            "load_errors": "Blocks kvtier could not give back (recomputed by vLLM).",
            "saved_blocks": "Blocks saved into kvtier's tiers.",
            "save_failures": "Saves kvtier's tiers refused (a later miss).",
        }
        self.counters = {
            name: {
                engine: counter.labels(*values)
                for engine, values in per_engine_labelvalues.items()
                for counter in [
                    self._counter_cls(
                        name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames
                    )
                ]
            }
            for name, doc in helps.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                counter: Any = self.counters[name][engine_idx]
                counter.inc(value)


class KVTierConnector(KVConnectorBase_V1):
    """vLLM's KV connector (v1 API) over kvtier's tiers. Both roles are this class: vLLM makes
    one for the scheduler and one for each worker."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._engine = str(transfer.engine_id)
        extra = dict(transfer.kv_connector_extra_config or {})
        self._block_size = int(vllm_config.cache_config.block_size)
        # Blocks one step may complete: what the connector's staging levels hold.
        step_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self._stage_blocks = -(-step_tokens // self._block_size)
        self.config = connector_config(extra, block_size=self._block_size)
        self._saves_kv = transfer.kv_role in ("kv_producer", "kv_both")
        self._loads_kv = transfer.kv_role in ("kv_consumer", "kv_both")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "KVTierConnector supports tensor parallelism, not pipeline parallelism "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size}) yet"
            )
        self._tp_size = int(parallel.tensor_parallel_size)
        self._spec = _attention_spec(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            policy = extra.get("load_failure_policy", "recompute")
            if policy not in ("recompute", "fail"):
                raise ConfigError(
                    f"load_failure_policy: expected 'recompute' or 'fail', got {policy!r}"
                )
            # A block the tiers cannot give back is a miss: vLLM recomputes it.
            transfer.kv_load_failure_policy = policy
        async_loads = extra.get("async_loads", "auto")
        if isinstance(async_loads, bool):  # JSON true/false
            async_loads = "always" if async_loads else "never"
        self._async_loads = str(async_loads).lower()
        if self._async_loads not in ASYNC_LOADS:
            raise ConfigError(
                f"async_loads: expected one of {', '.join(ASYNC_LOADS)}, "
                f"got {extra['async_loads']!r}"
            )
        self._scorer = _import_scorer(extra.get("scorer"))
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._hits: dict[str, _Hit] = {}
        #: this step's admitted loads, for get_external_cache_hit_sources: (start, held)
        self._admitted: dict[str, tuple[int, Held]] = {}
        #: each admitted request's cache_salt (a request of unknown salt is never saved)
        self._salts: dict[str, str | None] = {}
        self._loads: list[LoadSpec] = []
        self._finish_saves: list[SaveSpec] = []
        self._link: Link | None = None
        self._counters = Counters()  # the scheduler's: lookups and hits
        self._reported: dict[str, int] = {}  # counters as last handed to vLLM's stats
        # worker side
        self._tiers: WorkerTiers | None = None
        self._rank = 0  # tensor-parallel rank, known once the caches are registered
        self._listener: Any = None
        self._failed_blocks: set[int] = set()
        self._saved_finished: set[str] = set()
        self._loader: Executor | None = None  # background loads, one at a time
        self._layer_thread: Executor | None = None  # this step's loads, a layer at a time
        self._layer_loads: _LayerLoads | None = None
        self._layer_index: dict[str, int] = {}
        self._loaded: queue.SimpleQueue[tuple[str, int, list[int]]] = queue.SimpleQueue()

    # -- shared ----------------------------------------------------------------------------------

    @property
    def tiers(self) -> WorkerTiers:
        """The worker's manager, layout and caches (worker side only)."""
        if self._tiers is None:
            raise KvtierError("KVTierConnector: no KV caches registered (worker side only)")
        return self._tiers

    @property
    def link(self) -> Link:
        """The worker's tiers as the scheduler sees them: directly in one process, else over
        the worker's socket."""
        if self._link is None:
            self._link = link_to_worker(self._engine, self._tp_size)
        return self._link

    def get_compression_stats(self) -> dict[str, Any]:
        """The tiers' figures (``memory_saved_mb``, ``avg_compression_ratio``, bytes per tier
        and level: the manager's ``device`` tier is this connector's host tier) and, under
        ``connector``, what the connector did (lookups and hit tokens: the scheduler's; loaded
        and saved blocks, load errors: the worker's). On the scheduler side it asks the worker;
        with tensor parallelism, rank 0's figures, and each rank's under ``ranks``.

        ``connector`` also splits ``hit_tokens`` (the tokens beyond vLLM's own hit that the
        scheduler's lookups found) by where the lookup found them: ``hit_tokens_by_tier``
        (``host``, ``disk``, ``remote``: the connector's tiers), ``hit_tokens_by_level`` (the
        ladder's codec names) and ``hit_tokens_by_tier_level`` (``{tier: {level: tokens}}``),
        a zero for each tier and level the tiers have that had no hit."""
        stats = self._tiers.stats() if self._tiers is not None else self.link.stats()
        counters = stats.pop("worker")
        for rank in stats.get("ranks", ()):  # tensor parallel: each worker's own figures
            rank["connector"] = rank.pop("worker")
        mine = self._counters if self.role == KVConnectorRole.SCHEDULER else Counters()
        own = mine.as_dict()
        counters = {k: v + own[k] for k, v in counters.items()}
        pools = stats.get("pools", ())
        tiers = list(dict.fromkeys(CONNECTOR_TIERS[p["tier"]] for p in pools))
        levels = list(dict.fromkeys(p["codec"] for p in sorted(pools, key=lambda p: p["level"])))
        stats["connector"] = {**counters, **mine.hits_by(tiers, levels)}
        return stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters since the last call (vLLM adds the two sides up; of the
        tensor-parallel workers, rank 0 counts for all: they load and save the same blocks)."""
        if self._rank != 0:
            return None
        counters = (self._tiers.counters if self._tiers is not None else self._counters).as_dict()
        delta = {k: v - self._reported.get(k, 0) for k, v in counters.items()}
        self._reported = counters
        return KVTierStats(data=delta) if any(delta.values()) else None

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
        self._finish_layer_loads()
        for pool in (self._loader, self._layer_thread):
            if pool is not None:
                pool.shutdown(wait=True)
        self._loader = self._layer_thread = None
        if self._tiers is not None:
            forget(self._engine, self._tiers, self._listener, self._rank)
            self._listener = None
            self._tiers.manager.close()

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(self._spec_layers)
        self._layer_index = {name: i for i, name in enumerate(names)}
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KVTierConnector: no KV cache registered for layers {missing}")
        caches = [kv_caches[n] for n in names]
        backend = _backend_name(self._vllm_config, names[0])
        spec = self._spec
        layouts = {
            layout_for_backend(
                backend,
                c,
                num_kv_heads=spec.num_kv_heads,
                block_size=self._block_size,
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
        self._rank = _tp_rank(self._vllm_config)
        namespace = _namespace(self._vllm_config, spec, self.config.namespace, self._rank)
        config = self.config.replace(namespace=f"{namespace}/{layout.name}")
        if config.pool_shares is None and config.enable_compression and config.levels > 1:
            shape = BlockShape(
                len(caches),
                spec.num_kv_heads,
                self._block_size,
                spec.head_size,
                dtype_name(caches[0].dtype),
            )
            config = config.replace(pool_shares=staging_shares(config, shape, self._stage_blocks))
        if self._tp_size > 1 and config.disk_path is not None:  # a directory per rank
            config = config.replace(disk_path=os.path.join(config.disk_path, f"tp{self._rank}"))
        manager = BlockManager(
            config,
            num_layers=len(caches),
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            dtype=caches[0].dtype,
            device="cpu",
        )
        self._tiers = WorkerTiers(manager, layout, caches)
        self._listener = serve(self._engine, self._tiers, self._rank)
        log.info(
            "kvtier: %d layers, layout %s, tiers %s, ladder %s",
            len(caches),
            layout.name,
            [t for t, _ in manager.core.tiers],
            ",".join(manager.ladder),
        )

    @property
    def _spec_layers(self) -> list[str]:
        return list(self._kv_cache_config.kv_cache_groups[0].layer_names)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts this step's loads: background ones on their own thread (their requests wait
        for them), the others a layer at a time on the layer thread, while the forward pass
        runs (each attention layer waits for its own, in :meth:`wait_for_layer_load`)."""
        self._finish_layer_loads()  # a step whose loads no one waited for (no save pass)
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        now = []
        for load in meta.loads:
            if load.background:
                self._loader = self._loader or ThreadPoolExecutor(1, "kvtier-load")
                self._loader.submit(self._load_in_background, load)
            else:
                now.append(load)
        if now:
            self._layer_thread = self._layer_thread or ThreadPoolExecutor(1, "kvtier-layers")
            self._layer_loads = _LayerLoads(self.tiers, now, self._layer_thread)

    def _finish_layer_loads(self) -> None:
        """Waits for this step's layer-wise loads (every layer is in by now, unless vLLM ran
        no forward pass) and hands their failed blocks to vLLM."""
        if self._layer_loads is not None:
            for ok, failed in self._layer_loads.finish():
                self._count_load(ok, failed)
            self._layer_loads = None

    def _load_in_background(self, load: LoadSpec) -> None:
        try:
            ok, failed = self._load(load)
        except BaseException:  # never leave the request waiting: a failed load is recomputed
            log.exception("kvtier: background load of request %s failed", load.req_id)
            ok, failed = 0, load.block_ids
        self._loaded.put((load.req_id, ok, failed))

    def _count_load(self, ok: int, failed: list[int]) -> None:
        self._failed_blocks.update(failed)
        self.tiers.counters.loaded_blocks += ok
        self.tiers.counters.load_errors += len(failed)

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
                ok = load_blocks(
                    manager,
                    tiers.layout,
                    tiers.caches,
                    seq,
                    load.start,
                    len(load.tokens),
                    load.block_ids,
                )
            except KvtierError as exc:  # a block lost in the tiers: vLLM recomputes them all
                log.warning("kvtier: load of request %s failed (%s); recomputing", load.req_id, exc)
                ok = 0
            finally:
                manager.free(seq)
        return ok, load.block_ids[ok:]

    def wait_for_layer_load(self, layer_name: str) -> None:
        loads, layer = self._layer_loads, self._layer_index.get(layer_name)
        if loads is not None and layer is not None:
            loads.wait(layer)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves read every layer after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self._finish_layer_loads()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        for save in meta.saves:
            self._save(save)
        if meta.saves:
            self.tiers.manager.step()
        self._saved_finished |= meta.finishing

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose last blocks are saved (vLLM may free their blocks now), and
        requests whose background load is over (they may run now). vLLM asks for load errors
        right after this: a load's failed blocks are handed over with its request."""
        saved, self._saved_finished = self._saved_finished, set()
        loaded: set[str] = set()
        while not self._loaded.empty():
            req_id, ok, failed = self._loaded.get()
            loaded.add(req_id)
            self._count_load(ok, failed)
        return saved or None, loaded or None

    def _save(self, save: SaveSpec) -> None:
        """Saves what the tiers lack of the request's complete blocks so far, in pieces of at
        most half the host tier's level-0 pool: the blocks a piece writes stay at level 0
        until written, and the next piece makes room by demoting them (a long prompt, or a
        long prefill chunk, fits a level 0 kept small for capacity)."""
        bs = self._block_size
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
            tiers.counters.save_failures += 1
            return False
        first = manager.num_tokens(seq) // self._block_size  # blocks the tiers held already
        scores: list[torch.Tensor] = []

        def score(layer: int, keys: torch.Tensor) -> None:
            scores.append(self._score(save.req_id, layer, keys))

        on_keys = None if self._scorer is None else score
        try:
            saved = save_blocks(manager, tiers.layout, tiers.caches, seq, save.block_ids, on_keys)
            tiers.counters.saved_blocks += saved
            if scores and all(len(x) == saved for x in scores):  # mean over the layers
                manager.set_learned_scores(seq, torch.stack(scores).mean(0).numpy(), first)
        except KvtierError as exc:
            log.warning("kvtier: save of request %s failed (%s)", save.req_id, exc)
            tiers.counters.save_failures += 1
            return False
        finally:
            manager.free(seq)
        return True

    def _score(self, req_id: str, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """The user's scorer on one layer's keys of the blocks saved; a failing scorer leaves
        them unscored (the other signals rank them)."""
        assert self._scorer is not None
        try:
            scores = torch.as_tensor(self._scorer(layer, keys), dtype=torch.float32)
            scores = scores.reshape(-1).cpu()
            if len(scores) != len(keys) or not bool((torch.isfinite(scores) & (scores >= 0)).all()):
                raise ValueError(
                    f"expected {len(keys)} finite non-negative scores, got {scores.tolist()}"
                )
        except Exception as exc:
            log.warning("kvtier: scorer failed on request %s, layer %d: %s", req_id, layer, exc)
            return torch.empty(0)
        return scores

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit the tiers can load; loaded in the background (the
        request waits, others run) when some of them are on disk or on the server
        (``async_loads``: ``auto``), or always, or never."""
        salt = self._salts[request.request_id] = request.cache_salt or None
        if not self._loads_kv:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        # vLLM computes at least the prompt's last token itself.
        try:
            held = self.link.lookup(tokens[: len(tokens) - 1], salt)
        except KvtierError as exc:
            log.warning("kvtier: lookup failed (%s); a miss", exc)
            return 0, False
        counters = self._counters
        counters.lookups += 1
        hit = held.tokens
        if hit <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        background = self._async_loads == "always" or (
            self._async_loads == "auto" and held.resident < hit
        )
        self._hits[request.request_id] = _Hit(num_computed_tokens, hit, background, held)
        counters.count_hits(held.places(num_computed_tokens, hit))
        return hit - num_computed_tokens, background

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        start = hit.start
        end = min(hit.end, start + num_external_tokens)
        bs = self._block_size
        block_ids = list(blocks.get_block_ids()[0])[start // bs : end // bs]
        # A synchronous load runs before the step's saves: what the lookup found is there (a
        # background one may find less, which is a load error: recomputed).
        tokens = list(request.prompt_token_ids or [])[:end]
        salt = self._salts.get(request.request_id)
        load = LoadSpec(request.request_id, salt, tokens, start, block_ids, hit.background)
        self._loads.append(load)
        self._admitted[request.request_id] = (start, hit.held)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The tokens vLLM admitted from the tiers for ``request`` this step, by the tier the
        lookup found them in (vLLM's ``vllm:prompt_tokens_cached_by_source``): ``host`` for
        host memory, ``disk``, and ``external_unspecified`` for the server (see
        :data:`HIT_SOURCES`)."""
        admitted = self._admitted.pop(request.request_id, None)
        if admitted is None:
            return hit_sources({}, num_external_tokens)
        start, held = admitted
        return hit_sources(held.places(start, start + num_external_tokens), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierMetadata(loads=self._loads, saves=self._finish_saves)
        meta.finishing = {save.req_id for save in self._finish_saves}
        self._loads, self._finish_saves = [], []
        self._admitted.clear()  # vLLM asks for a load's sources in the step that admits it
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None or new.req_id not in self._salts:
                continue  # prompt embeddings (no token ids to key them by), or salt unknown
            salt = self._salts[new.req_id]
            req = _Request(salt, list(new.prompt_token_ids), list(new.block_ids[0]))
            self._requests[new.req_id] = req
            self._plan_save(meta, new.req_id, req, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                known.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                known.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, known, cached.num_computed_tokens[i] + scheduled[req_id])
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._salts.pop(req_id, None)
        return meta

    def _plan_save(self, meta: KVTierMetadata, req_id: str, req: _Request, computed: int) -> None:
        """Saves the prompt's blocks that are complete once this step has run."""
        if not self._saves_kv:
            return
        end = min(computed, len(req.tokens)) // self._block_size * self._block_size
        if end <= req.saved:
            return
        req.saved = end
        blocks = end // self._block_size
        meta.saves.append(SaveSpec(req_id, req.salt, req.tokens[:end], req.block_ids[:blocks]))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves the request's complete blocks beyond its prompt (what it generated: the next
        turn of a conversation starts with them) in the next step, and keeps vLLM from freeing
        them until then."""
        req = self._requests.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._salts.pop(request.request_id, None)
        if req is None or not self._saves_kv:
            return False, None
        tokens = list(request.all_token_ids)[: request.num_computed_tokens]
        end = len(tokens) // self._block_size * self._block_size
        if end <= req.saved or len(block_ids) < end // self._block_size:
            return False, None
        blocks = list(block_ids[: end // self._block_size])
        save = SaveSpec(request.request_id, req.salt, tokens[:end], blocks)
        self._finish_saves.append(save)
        return True, None


class _LayerLoads:
    """One step's synchronous loads, a layer at a time on the worker's layer thread, so that
    the forward pass computes layer ``i`` while layer ``i + 1`` loads. On a GPU the copies go
    on a stream of their own and each layer's attention waits for its event."""

    def __init__(self, tiers: WorkerTiers, loads: list[LoadSpec], thread: Executor) -> None:
        self.ready = [threading.Event() for _ in tiers.caches]
        self.events: list[Any] = [None] * len(tiers.caches)
        self.results: list[tuple[int, list[int]]] = []
        self.job = thread.submit(self._run, tiers, loads)

    def _run(self, tiers: WorkerTiers, loads: list[LoadSpec]) -> None:
        manager, caches = tiers.manager, tiers.caches
        work: list[tuple[LoadSpec, int | None, list[int]]] = []  # load, sequence, blocks to write
        cuda = caches[0].device.type == "cuda"
        try:
            for load in loads:
                try:
                    seq = manager.add_sequence(load.tokens, salt=load.salt)
                    ok = loadable_blocks(
                        manager,
                        tiers.layout,
                        len(caches),
                        seq,
                        load.start,
                        len(load.tokens),
                        len(load.block_ids),
                    )
                    work.append((load, seq, load.block_ids[:ok]))
                except KvtierError as exc:
                    log.warning("kvtier: load of request %s failed (%s)", load.req_id, exc)
                    work.append((load, None, []))
            stream = torch.cuda.Stream(caches[0].device) if cuda else None  # type: ignore[no-untyped-call]
            for layer, cache in enumerate(caches):
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for i, (load, held, ids) in enumerate(work):
                        if held is None or not ids:
                            continue
                        try:
                            load_layer(manager, tiers.layout, cache, layer, held, load.start, ids)
                        except Exception as exc:  # a block lost in the tiers: all recomputed
                            log.warning("kvtier: load of request %s failed (%s)", load.req_id, exc)
                            work[i] = (load, held, [])
                    if stream is not None:
                        self.events[layer] = stream.record_event()
                self.ready[layer].set()
            if stream is not None:
                stream.synchronize()
        finally:
            for ready in self.ready:  # no layer waits for ever
                ready.set()
            for _, held, _ in work:
                if held is not None:
                    manager.free(held)
            # One entry per load, in order (a load never reached wrote nothing).
            self.results = [(len(ids), load.block_ids[len(ids) :]) for load, _, ids in work]
            self.results += [(0, load.block_ids) for load in loads[len(work) :]]

    def wait(self, layer: int) -> None:
        self.ready[layer].wait()
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def finish(self) -> list[tuple[int, list[int]]]:
        """Per load: the blocks written and those that were not."""
        self.job.result()
        return self.results


# -- helpers -------------------------------------------------------------------------------------


def _attention_spec(kv_cache_config: KVCacheConfig) -> Any:
    """The one full-attention spec the connector supports, or a clear refusal."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1:
        raise ConfigError(
            f"KVTierConnector supports models with one KV-cache group (full attention in every "
            f"layer); this model has {len(groups)}: {kinds} (hybrid or sliding-window models "
            "are not supported yet)"
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, MLAAttentionSpec) or type(spec) is not FullAttentionSpec:
        raise ConfigError(
            f"KVTierConnector supports full attention (FullAttentionSpec); this model's KV cache "
            f"is {kinds[0]} (MLA, sliding-window and state-space caches are not supported yet)"
        )
    if getattr(spec, "sliding_window", None):
        raise ConfigError("KVTierConnector does not support sliding-window attention yet")
    return spec


def _import_scorer(path: object) -> Callable[[int, torch.Tensor], Any] | None:
    """``"package.module:function"``: the learned importance of the blocks saved,
    ``function(layer, keys)`` with ``keys`` ``[blocks, block_size, kv_heads, head_dim]`` →
    one finite, non-negative score per block (higher: kept at higher precision); averaged over
    layers."""
    if path is None:
        return None
    module, _, name = str(path).partition(":")
    try:
        scorer = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"scorer: expected 'package.module:function' naming an importable function, got "
            f"{path!r} ({exc})"
        ) from None
    if not callable(scorer):
        raise ConfigError(f"scorer: {path!r} is not callable")
    return cast("Callable[[int, torch.Tensor], Any]", scorer)


def _backend_name(vllm_config: VllmConfig, layer_name: str) -> str:
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    if backend is None:
        raise ConfigError(f"KVTierConnector: layer {layer_name} has no attention backend")
    return str(backend.get_name())


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return 0
    from vllm.distributed import parallel_state

    try:
        return int(parallel_state.get_tensor_model_parallel_rank())
    except AssertionError:  # no tensor-parallel group: a worker driven by hand
        return int(vllm_config.parallel_config.rank) % size


def _namespace(vllm_config: VllmConfig, spec: Any, user: str, rank: int) -> str:
    """What stored blocks depend on besides their tokens: the model and its revision, the KV
    dtype, the block size and parallel rank (the layout is added when the worker knows it),
    and the user's namespace (a tenant, a weights version)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = str(spec.dtype).removeprefix("torch.")
    parts = [
        "vllm",
        str(model.model),
        str(model.revision or "main"),
        dtype,
        f"bs{spec.block_size}",
        f"tp{rank}of{parallel.tensor_parallel_size}",
        user,
    ]
    return "|".join(parts)
