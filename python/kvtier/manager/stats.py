"""What a manager reports: :class:`ManagerStats` (per-pool occupancy, bytes held and saved,
move counters) and its Prometheus text.

Figures are read from the core when :func:`collect` is called; nothing here holds state
between calls. A ``drop`` level holds no slots: its device row counts the blocks of live
sequences that have left attention.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core import Core
from .._torch import cuda_fallback

__all__ = ["ManagerStats", "PoolStats", "collect"]


@dataclass(frozen=True)
class PoolStats:
    """Occupancy of one (tier, level) pool, from the core's slot counts."""

    tier: str
    level: int
    codec: str
    blocks: int
    capacity_blocks: int
    bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class ManagerStats:
    """What :meth:`BlockManager.stats` reports; every byte figure is real pool occupancy."""

    pools: tuple[PoolStats, ...]
    #: bytes the held blocks take, and what they would take at level 0
    held_bytes: int
    level0_bytes: int
    counters: dict[str, int] = field(default_factory=dict)
    sequences: int = 0
    tokens: int = 0
    #: why calls on CUDA tensors in this process ran the torch reference rather than kvtier's
    #: CUDA kernels (CuPy does not import), with what to install; None while none has
    cuda_fallback: str | None = None

    @property
    def memory_saved_mb(self) -> float:
        """Megabytes (10^6) saved against holding the same blocks at level 0."""
        return (self.level0_bytes - self.held_bytes) / 1e6

    @property
    def avg_compression_ratio(self) -> float:
        """Level-0 bytes over held bytes of the blocks held (1.0 = nothing compressed)."""
        return self.level0_bytes / self.held_bytes if self.held_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        """The figures of ``get_compression_stats()``: plain numbers, JSON-ready."""
        c = self.counters
        return {
            "memory_saved_mb": self.memory_saved_mb,
            "avg_compression_ratio": self.avg_compression_ratio,
            "held_bytes": self.held_bytes,
            "level0_bytes": self.level0_bytes,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "pools": [vars(p) for p in self.pools],
            "promotions": c.get("promotions", 0),
            "demotions": c.get("demotions", 0),
            "offloads": c.get("offloads", 0),
            "fetches": c.get("fetches", 0),
            "evictions": c.get("evictions", 0),
            "backups": c.get("backups", 0),
            "hits": c.get("shared_hits", 0),
            "noop_promotions": c.get("noop_promotions", 0),
            "counters": dict(c),
            "cuda_fallback": self.cuda_fallback,
        }

    def to_prometheus(self, prefix: str = "kvtier") -> str:
        """The stats in the Prometheus text exposition format."""
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, rows: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {prefix}_{name} {help}")
            lines.append(f"# TYPE {prefix}_{name} {kind}")
            lines.extend(f"{prefix}_{name}{labels} {value:g}" for labels, value in rows)

        def labels(p: PoolStats) -> str:
            return f'{{tier="{p.tier}",level="{p.level}",codec="{p.codec}"}}'

        metric(
            "pool_blocks",
            "gauge",
            "Blocks held per pool.",
            [(labels(p), p.blocks) for p in self.pools],
        )
        metric(
            "pool_capacity_blocks",
            "gauge",
            "Slots per pool.",
            [(labels(p), p.capacity_blocks) for p in self.pools],
        )
        metric(
            "pool_bytes",
            "gauge",
            "Bytes held per pool.",
            [(labels(p), p.bytes) for p in self.pools],
        )
        metric("held_bytes", "gauge", "Bytes held over all pools.", [("", self.held_bytes)])
        metric(
            "memory_saved_bytes",
            "gauge",
            "Bytes saved against level 0.",
            [("", self.level0_bytes - self.held_bytes)],
        )
        metric(
            "compression_ratio",
            "gauge",
            "Level-0 bytes over held bytes.",
            [("", self.avg_compression_ratio)],
        )
        moves = ("demotions", "promotions", "offloads", "fetches", "evictions", "backups")
        metric(
            "moves_total",
            "counter",
            "Blocks moved, by kind.",
            [(f'{{kind="{k}"}}', self.counters.get(k, 0)) for k in moves],
        )
        metric(
            "prefix_hits_total",
            "counter",
            "Blocks shared from the prefix cache.",
            [("", self.counters.get("shared_hits", 0))],
        )
        metric("sequences", "gauge", "Live sequences.", [("", self.sequences)])
        metric(
            "cuda_fallback",
            "gauge",
            "1 when calls on CUDA tensors ran the torch reference (CuPy does not import).",
            [("", int(self.cuda_fallback is not None))],
        )
        return "\n".join(lines) + "\n"


def collect(
    core: Core,
    ladder: Sequence[str],
    level_bytes: Sequence[int],
    drop_level: int | None,
    live: Collection[int],
    tokens: int,
    counters: dict[str, int],
) -> ManagerStats:
    """The stats of a manager whose live sequences are ``live`` (holding ``tokens`` tokens),
    with ``counters`` beside the core's own."""
    dropped = _dropped_blocks(core, drop_level, live)
    pools = tuple(
        PoolStats(
            tier=tier,
            level=level,
            codec=ladder[level],
            # a drop level holds no slots: it counts the blocks out of attention
            blocks=dropped if level == drop_level and tier == "device" else used,
            capacity_blocks=cap,
            bytes=nbytes,
            capacity_bytes=cap * level_bytes[level],
        )
        for tier, level, used, cap, nbytes in core.usage()
    )
    return ManagerStats(
        pools=pools,
        held_bytes=sum(p.bytes for p in pools),
        level0_bytes=sum(p.blocks for p in pools) * level_bytes[0],
        counters={**core.counters(), **counters},
        sequences=len(live),
        tokens=tokens,
        cuda_fallback=cuda_fallback(),
    )


def _dropped_blocks(core: Core, drop_level: int | None, live: Collection[int]) -> int:
    """Blocks of live sequences that a ``drop`` level took out of attention."""
    if drop_level is None or not live:
        return 0
    blocks = np.unique(np.concatenate([core.sequence_blocks(s) for s in live]))
    return int((core.block_info(blocks)["level"] == drop_level).sum())
