"""What the connector counts, and how the counts reach vLLM and the user.

Each side keeps its own :class:`Counters` (the scheduler: lookups and hit tokens, by where they
lie; the worker: loaded and saved blocks, load errors, failed saves). vLLM collects each side's
growth since its last report (:class:`CounterReports`, as :class:`KVTierStats`), adds the sides
up, logs them and exports them to Prometheus (:class:`KVTierPromMetrics`); hits go to its
``vllm:prompt_tokens_cached_by_source`` by the tier they lay in (:func:`hit_sources`).
:func:`connector_stats` is the ``connector`` part of ``get_compression_stats()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .link import CONNECTOR_TIERS, Place

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "FAILURES",
    "GAUGES",
    "HIT_SOURCES",
    "LOOKUP_COUNTS",
    "CounterReports",
    "Counters",
    "KVTierPromMetrics",
    "KVTierStats",
    "connector_stats",
    "hit_sources",
]

#: vLLM's label (``vllm:prompt_tokens_cached_by_source``) for hits in each of the connector's
#: tiers. The server is a store that engines share, not another vLLM instance handing its KV
#: over (vLLM's ``p2p``): vLLM files a remote store under ``external_unspecified``.
HIT_SOURCES = {
    "host": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
}


@dataclass
class Counters:
    """What the connector did, since its start."""

    lookups: int = 0
    hit_tokens: int = 0
    #: tokens the tiers held that a lookup did not offer: loading them had been costing more
    #: than recomputing them (:meth:`~.link.Held.paying`)
    unpaid_tokens: int = 0
    loaded_blocks: int = 0
    load_errors: int = 0
    saved_blocks: int = 0
    save_failures: int = 0
    #: blocks a save skipped because level 0 was full while the background step made room
    shed_blocks: int = 0
    #: blocks of finished requests that ended their conversations, released: evicted first
    released_blocks: int = 0
    #: bytes of vLLM's KV the loads wrote and the saves read (its blocks, at its dtype)
    loaded_bytes: int = 0
    saved_bytes: int = 0
    #: time the loads took (on the worker's threads, beside the forward pass) and the saves
    #: (within vLLM's step: a layer at a time in the forward pass, or after it)
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    #: ``hit_tokens`` by the place (tier, level name) where the lookup found them
    hits_by_place: dict[Place, int] = field(default_factory=dict)

    def count_hits(self, places: Mapping[Place, int]) -> None:
        """Counts hit tokens, by where they lie."""
        for place, tokens in places.items():
            self.hit_tokens += tokens
            self.hits_by_place[place] = self.hits_by_place.get(place, 0) + tokens

    def as_dict(self, without: Sequence[str] = ()) -> dict[str, float]:
        """The counts (what vLLM's stats carry: each adds up over intervals and workers), but
        those named in ``without``."""
        return {
            name: value
            for name, value in vars(self).items()
            if isinstance(value, int | float) and name not in without
        }

    def hits_by(self, tiers: Sequence[str], levels: Sequence[str]) -> dict[str, Any]:
        """``hit_tokens`` by tier, by level name and by both (``{tier: {level: tokens}}``), with
        a zero for each of ``tiers`` and ``levels`` that had none."""
        by_tier = dict.fromkeys(tiers, 0)
        by_level = dict.fromkeys(levels, 0)
        both = {tier: dict.fromkeys(levels, 0) for tier in tiers}
        for (tier, level), tokens in self.hits_by_place.items():
            by_tier[tier] = by_tier.get(tier, 0) + tokens
            by_level[level] = by_level.get(level, 0) + tokens
            both.setdefault(tier, dict.fromkeys(levels, 0))
            both[tier][level] = both[tier].get(level, 0) + tokens
        return {
            "hit_tokens_by_tier": by_tier,
            "hit_tokens_by_level": by_level,
            "hit_tokens_by_tier_level": both,
        }


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


#: Levels, not counts: the host tier's bytes held and its capacity, in every rank's tiers
#: together (rank 0 reports them: every rank holds its heads' shard of the same blocks). A report
#: carries their value at its time; vLLM's log line over an interval shows the highest.
GAUGES = ("host_held_bytes", "host_capacity_bytes")

#: The scheduler's counts: its lookups and the tokens they found (a worker looks nothing up: its
#: figures leave them out rather than claim zeros).
LOOKUP_COUNTS = ("lookups", "hit_tokens", "unpaid_tokens")

#: The worker's counts of what failed. Tensor-parallel ranks load and save the same blocks, so
#: rank 0 counts the blocks for all of them; but a block any rank fails to load is recomputed on
#: every rank, so each rank's failures count, added up (a block two ranks lost counts twice).
FAILURES = ("load_errors", "save_failures")


def connector_stats(stats: dict[str, Any], lookups: Counters | None) -> dict[str, Any]:
    """``get_compression_stats()`` from a worker's figures (``stats``: the tiers' figures with
    the worker's counters, less :data:`LOOKUP_COUNTS`, under ``worker``, each rank's under
    ``ranks`` with tensor parallelism) and, on the scheduler's side, its counters
    (``lookups``): under ``connector``, the worker's counts (with every rank's
    :data:`FAILURES`) added to the scheduler's, and the scheduler's hit tokens by tier and level
    (a zero for each tier and level the tiers have); each rank's counters under its
    ``connector``. Without ``lookups`` (a worker's own figures), no lookup count nor hit figure:
    the worker does not look prompts up."""
    counters = dict(stats.pop("worker"))  # with tensor parallelism, also rank 0's own
    for rank in stats.get("ranks", ()):  # tensor parallel: each worker's own figures
        rank["connector"] = rank.pop("worker")
    for rank in stats.get("ranks", ())[1:]:  # rank 0's are ``counters``
        for name in FAILURES:
            counters[name] += rank["connector"][name]
    if lookups is None:
        stats["connector"] = counters
        return stats
    mine = lookups.as_dict()
    counters = {k: counters.get(k, 0) + v for k, v in mine.items()}
    pools = stats.get("pools", ())
    tiers = list(dict.fromkeys(CONNECTOR_TIERS[p["tier"]] for p in pools))
    levels = list(dict.fromkeys(p["codec"] for p in sorted(pools, key=lambda p: p["level"])))
    stats["connector"] = {**counters, **lookups.hits_by(tiers, levels)}
    return stats


class CounterReports:
    """Hands vLLM the growth of ``counters`` since the last report."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._reported: dict[str, float] = {}  # counters as last handed to vLLM's stats

    def take(self, only: Sequence[str] | None = None) -> KVTierStats | None:
        """The growth since the last call (of the counters named in ``only``, if given), or
        None if nothing grew."""
        counters = self.counters.as_dict()
        delta = {k: v - self._reported.get(k, 0) for k, v in counters.items()}
        self._reported = counters
        if only is not None:
            delta = {k: delta[k] for k in only}
        return KVTierStats(data=delta) if any(delta.values()) else None

    def empty(self) -> KVTierStats:
        """A report of no growth (for figures that are not counts)."""
        return KVTierStats(data={})


@dataclass
class KVTierStats(KVConnectorStats):
    """The connector's counters over an interval (``Counters`` fields), for vLLM's logs
    ("KV Transfer metrics: ...") and its Prometheus endpoint (``vllm:kvtier_*_total``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in GAUGES:
                self.data[name] = max(self.data.get(name, 0), value)
            else:
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
            "unpaid_tokens": "Prompt tokens kvtier held but recomputing was faster.",
            "loaded_blocks": "Blocks loaded from kvtier's tiers into vLLM's.",
            "load_errors": "Blocks kvtier could not give back (recomputed by vLLM).",
            "saved_blocks": "Blocks saved into kvtier's tiers.",
            "save_failures": "Saves kvtier's tiers refused (a later miss).",
            "shed_blocks": "Blocks a save skipped, the tiers' level 0 full (a later miss).",
            "released_blocks": "Blocks of ended conversations, released (evicted first).",
            "loaded_bytes": "Bytes of vLLM's KV loaded from kvtier's tiers.",
            "saved_bytes": "Bytes of vLLM's KV saved into kvtier's tiers.",
            "load_seconds": "Seconds kvtier's loads took (beside the forward pass).",
            "save_seconds": "Seconds kvtier's saves took (within vLLM's step).",
        }
        gauges = {
            "host_held_bytes": "Bytes kvtier's host tier holds (every rank's).",
            "host_capacity_bytes": "Bytes kvtier's host tier can hold (every rank's).",
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
        gauge_cls: Any = self._gauge_cls  # vLLM's map of metric types is typed loosely
        self.gauges = {
            name: {
                engine: gauge.labels(*values)
                for engine, values in per_engine_labelvalues.items()
                for gauge in [
                    gauge_cls(
                        name=f"vllm:kvtier_{name}",
                        documentation=doc,
                        labelnames=labelnames,
                        multiprocess_mode="mostrecent",
                    )
                ]
            }
            for name, doc in gauges.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                counter: Any = self.counters[name][engine_idx]
                counter.inc(value)
            elif name in self.gauges:
                gauge: Any = self.gauges[name][engine_idx]
                gauge.set(value)
