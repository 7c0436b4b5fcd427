"""``BlockManager``: the tiered, mixed-precision KV store a custom engine calls.

The Rust core decides (which block lives where, at which level); this class owns the tensors and
moves the bytes. Per (tier, level) there is one pool, allocated once at construction:

- level 0 is a float pool ``[slots, layers, 2, kv_heads, block_size, head_dim]`` in the model
  dtype, where new K/V is written;
- every other level is a packed pool ``uint8 [slots, bytes_per_block]`` of its codec.

Each tier's budget is split between its levels by ``pool_shares`` (a fixed partition of memory:
the core keeps ``headroom`` free in each pool, demoting or offloading out of a full one).

Lifecycle of a block as the manager sees it: allocated at level 0 on the device when a sequence
grows, *pinned* (never moved) until every layer has written all its tokens, then free to be
demoted, offloaded, promoted by :meth:`BlockManager.step`. A block is shared between sequences by
prefix hash only once complete; a sequence that reuses a cached prefix skips writing it.

Tiers: ``device`` and ``host`` pools are tensors; ``disk`` and ``remote`` are
:mod:`kvtier.stores` (a directory, a Redis server), whose values are keyed by this manager's
instance id, level and slot, so the core addresses them exactly like a pool: as in a pool, a
slot a block leaves keeps its bytes until a block reuses it (no delete per move; the values stay
within the tier's budget, :meth:`BlockManager.close` deletes them all, and ``remote_ttl`` lets a
crashed engine's remote values expire). Moves to and from a store go in one batch per pool pair
and carry each level's packed bytes (an INT4 block moves a quarter of an fp16 one). A block a
store cannot give back (corrupt, evicted, server gone) is *lost*: never shared again, and
:class:`BlockLostError` for its sequence, never wrong K/V. A store that refuses a write (full,
server gone) is left out of plans for ``STORE_RETRY_S``.

Prefix sharing between engines (``share_prefixes``): each step first publishes the prompt blocks
completed since the last one to the remote server, at level 0 and keyed by their prefix hash in
the tier's level-0 namespace (so only engines of the same model, dtype, shape and namespace ever
read them); :meth:`BlockManager.add_sequence` takes the blocks of a prompt that this manager
lacks from there, up to the first miss. The server's ``maxmemory`` policy (or ``remote_ttl``)
bounds what is published; ``close()`` leaves it for the other engines. As for the local prefix
cache, a block's K/V must follow from its token ids alone within a namespace: add a request whose
K/V also depends on something else (an adapter, an image behind placeholder ids) without token ids,
so that its blocks are never shared, or give it a manager of its own namespace. Requests that may
share only among themselves (a tenant's, vLLM's ``cache_salt``) are added with a ``salt``: their
blocks' hashes, so their cache entries and remote keys, are chained from it, and a request with
another salt or none never finds them.

Thread safety: one lock guards the core and the pools' bookkeeping; :meth:`step` copies bytes
outside it (a plan's sources stay valid and its destinations reserved until commit, and appends
only write pinned blocks, which plans never move), so appends and gathers proceed meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ._core import Core, Plan, prefix_hashes, write_token
from ._torch import all_finite, as_tensor, dtype_name, torch_dtype, torch_module
from .attend import FLOAT_CODES, PoolView, describe, readable, run_attention
from .codecs import BlockShape, Codec, IdentityCodec, get_codec
from .config import KvtierConfig, normalize_dtype
from .errors import (
    BlockLostError,
    ConfigError,
    InvalidArgumentError,
    InvalidSequenceError,
    OutOfCapacityError,
)
from .stores import DiskStore, KVStore, Namespace, RedisStore

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier.manager")

_T = TypeVar("_T")

__all__ = ["BlockManager", "ManagerStats", "PoolStats"]

TIERS = ("device", "host", "disk", "remote")
#: Tiers held in a :class:`KVStore` rather than a tensor pool.
STORE_TIERS = ("disk", "remote")
#: Seconds a store tier that refused a write is left out of plans.
STORE_RETRY_S = 1.0
#: The device budget when neither ``device_budget`` nor ``device_blocks`` is set: this share of
#: the free CUDA memory, or a fixed amount of CPU memory.
DEFAULT_CUDA_SHARE = 0.5
DEFAULT_CPU_BYTES = 1 << 30
#: Slots one pool can index (the core's slot ids are 32-bit).
MAX_POOL_SLOTS = (1 << 32) - 1


def default_shares(levels: int, level_bytes: Sequence[int], ratio: float) -> tuple[float, ...]:
    """Half of a tier to level 0 (new blocks and every sequence's recent window), the other half
    split so that levels 1 and 2 hold blocks in the proportion ``compression_ratio`` asks for."""
    if levels == 1:
        return (1.0,)
    if levels == 2:
        return (0.5, 0.5)
    want = [ratio * level_bytes[1], (1 - ratio) * level_bytes[2]]
    rest = [0.0] * (levels - 3)  # levels below 2 get nothing unless configured
    total = sum(want) or 1.0
    return (0.5, 0.5 * want[0] / total, 0.5 * want[1] / total, *rest)


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
        return "\n".join(lines) + "\n"


@dataclass
class _Seq:
    #: tokens written per layer
    lengths: np.ndarray
    #: the block being filled, where one-token appends write: ``(index in the sequence, block
    #: id, level-0 device slot)``; it is pinned, so it stays there until complete
    tail: tuple[int, int, int] | None = None


@dataclass
class _AttentionBatch:
    """Where the blocks of a batch of sequences lie, as the attention kernels read them."""

    #: the manager's epoch it was built in (blocks move: a new epoch)
    epoch: int
    #: per sequence, its blocks
    blocks: list[np.ndarray]
    counts: list[int]
    #: ``[sequences, max blocks]`` int32: the attention pool of each block (-2: staged, -1:
    #: none) and its slot
    pools: np.ndarray
    slots: np.ndarray
    staged: bool
    #: ``(row, column, block)`` of the blocks that were not complete in every layer when it was
    #: built: a shared one may not be written yet at the layer attention reads
    unsure: list[tuple[int, int, int]]
    #: per sequence, the index of its first block still in attention (not dropped)
    first_kept: np.ndarray

    @classmethod
    def build(cls, bm: BlockManager, ids: tuple[int, ...]) -> _AttentionBatch:
        blocks = [bm.core.sequence_blocks(s) for s in ids]
        counts = [len(b) for b in blocks]
        width = max(counts, default=0)
        pools = np.full((len(ids), width), -1, dtype=np.int32)
        slots = np.zeros((len(ids), width), dtype=np.int32)
        unsure = []
        for row, (seq, b) in enumerate(zip(ids, blocks, strict=True)):
            bm._check_not_lost(seq, b)
            info = bm.core.block_info(b)
            pools[row, : len(b)] = bm._attend_lut[info["tier"], info["level"]]
            slots[row, : len(b)] = info["slot"]
            for col in np.nonzero((bm._written[b] < bm.block_size).any(axis=1))[0].tolist():
                unsure.append((row, col, int(b[col])))
        staged = bool((pools == -2).any())
        kept = pools != -1
        first_kept = np.where(kept.any(axis=1), kept.argmax(axis=1), counts)
        return cls(bm._epoch, blocks, counts, pools, slots, staged, unsure, first_kept)

    def check(
        self, bm: BlockManager, ids: tuple[int, ...], tokens: list[int], layer: int, queries: int
    ) -> None:
        """Raises for a query that would see no key (every block up to its own dropped: a
        chunk longer than the recent window) and for a block of the first ``tokens`` tokens
        that ``layer`` has not written (a shared block whose owner is behind; usually one block
        a sequence: the one being filled)."""
        bs, written = bm.block_size, bm._written
        first = np.asarray(tokens) - queries  # each sequence's first query's position
        blind = np.nonzero(self.first_kept * bs > first)[0]
        if len(blind):
            row = int(blind[0])
            raise InvalidArgumentError(
                f"q: the query at token {first[row]} of sequence {ids[row]} would see no key: "
                f"its blocks before token {self.first_kept[row] * bs} have left attention (the "
                f"drop level); a chunk of {queries} queries needs a recent_window of at least "
                f"{queries} tokens"
            )
        for row, col, block in self.unsure:
            need = min(bs, tokens[row] - bs * col)
            if need > 0 and written[block, layer] < need:
                raise InvalidArgumentError(
                    f"sequence {ids[row]} layer {layer}: block {block} is shared but its owner "
                    "has not written this layer yet; append the owner's layer first"
                )


class BlockManager:
    """Tiered KV storage for one model: append K/V, gather it for attention, ``step()`` to let
    the scheduler move blocks between levels and tiers.

    ``config`` defaults to :meth:`KvtierConfig.from_env`. ``dtype`` is the model's K/V dtype
    (``torch.float16``, ``"bf16"`` ...); ``device`` where the device tier lives (default: CUDA
    when available, else the CPU). K/V cross as ``[num_tokens, num_kv_heads, head_dim]`` tensors
    (any DLPack producer) in that dtype and on that device.
    """

    def __init__(
        self,
        config: KvtierConfig | None,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = "fp16",
        device: Any = None,
    ) -> None:
        torch = torch_module()
        self.config = config = KvtierConfig.from_env() if config is None else config
        if not isinstance(config, KvtierConfig):
            raise ConfigError(f"config: expected a KvtierConfig, got {type(config).__name__}")
        dtype_str = dtype_name(dtype) if isinstance(dtype, torch.dtype) else normalize_dtype(dtype)
        self.shape = BlockShape(num_layers, num_kv_heads, config.block_size, head_dim, dtype_str)
        self.dtype = torch_dtype(dtype_str)
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ladder = config.resolved_ladder(dtype_str)
        if self.ladder[0] != dtype_str:
            raise ConfigError(
                f"ladder: level 0 is {self.ladder[0]!r} but the model dtype is {dtype_str!r}: "
                "level 0 holds K/V exactly as the model wrote it"
            )
        # A `drop` level (last, checked by the config) holds no bytes: its blocks have left
        # attention. It has no codec, pool nor store; gather and attend skip its blocks.
        kept = self.ladder[:-1] if self.ladder[-1] == "drop" else self.ladder
        self.drop_level = len(kept) if len(kept) < len(self.ladder) else None
        self.codecs: list[Codec] = [get_codec(name) for name in kept]
        self.level_bytes = [c.bytes_per_block(self.shape) for c in self.codecs]
        self.level_bytes += [0] * (len(self.ladder) - len(kept))
        budgets: dict[str, int] = {"device": self._device_budget()}
        for tier in TIERS[1:]:
            budget = self._budget(tier)
            if budget is not None:
                budgets[tier] = budget
        if config.write_through and len(budgets) == 1:
            raise ConfigError(
                "write_through: needs a tier after the device to keep full-precision copies in; "
                "set host_budget (or host_blocks), disk_budget or remote_budget"
            )
        if config.share_prefixes and "remote" not in budgets:
            raise ConfigError(
                "share_prefixes: needs a remote tier to share through: set remote_budget and "
                "remote_url"
            )
        if config.share_prefixes and config.namespace == KvtierConfig().namespace:
            # Keys say tokens, shape and dtype, not which weights: only the namespace does.
            raise ConfigError(
                "share_prefixes: set namespace to name the model and its weights (e.g. "
                "'SmolLM2-135M@rev'): engines share blocks within a namespace, and two models of "
                "one shape under the default name would read each other's K/V"
            )
        shares = config.pool_shares or default_shares(
            len(self.codecs), self.level_bytes, config.compression_ratio
        ) + (0.0,) * (len(self.ladder) - len(self.codecs))
        self.slots: dict[tuple[str, int], int] = {}
        for tier, budget in budgets.items():
            assert budget is not None
            for level, (share, nbytes) in enumerate(zip(shares, self.level_bytes, strict=True)):
                self.slots[tier, level] = int(share * budget // nbytes) if nbytes else 0
        if self.slots["device", 0] < 1:
            raise ConfigError(
                f"device budget {budgets['device']} B holds no level-0 block of "
                f"{self.level_bytes[0]} B at level-0 share {shares[0]:g}: raise device_budget "
                "or device_blocks"
            )
        self._check_pool_sizes(budgets)
        self._tiers = list(budgets)
        self.core = Core(
            self.level_bytes,
            tiers=[
                (t, sum(self.slots[t, lv] * b for lv, b in enumerate(self.level_bytes)))
                for t in self._tiers
            ],
            block_size=config.block_size,
            policy=config.policy,
            enable_compression=config.enable_compression,
            compression_ratio=config.compression_ratio,
            drop_ratio=config.drop_ratio,
            recent_window=config.recent_window,
            sink_blocks=config.sink_blocks,
            weights=config.weights,
            headroom=config.headroom,
            hysteresis=config.hysteresis,
            max_move_bytes=config.max_move_bytes,
            decay=config.decay,
            attention_ema=config.attention_ema,
            scissorhands_window=config.scissorhands_window,
            write_through=config.write_through,
            # Allocations never evict at once: a plan demotes and offloads first, and only the
            # retry after it may evict cached blocks (when config.evict_on_full), see _with_room.
            evict_on_full=False,
            namespace=config.namespace,
            pool_slots=[(t, lv, n) for (t, lv), n in self.slots.items()],
            pool_headroom=True,
            prefix_aware=config.prefix_aware,
        )
        self.instance = uuid.uuid4().hex[:16]
        self.pools: dict[tuple[str, int], Any] = {}
        for (tier, level), n in self.slots.items():
            if tier in STORE_TIERS or level == self.drop_level:
                continue
            on = self.device if tier == "device" else torch.device("cpu")
            pin = tier == "host" and self.device.type == "cuda"
            shape = (n, *self.shape.dims) if level == 0 else (n, self.level_bytes[level])
            dt = self.dtype if level == 0 else torch.uint8
            try:
                self.pools[tier, level] = torch.empty(shape, dtype=dt, device=on, pin_memory=pin)
            except RuntimeError as exc:  # torch's out-of-memory errors among them
                raise ConfigError(
                    f"{tier} budget: could not allocate its level-{level} pool of "
                    f"{n * self.level_bytes[level]} B on {on} ({exc}); lower the {tier} budget"
                ) from None
        self.stores = self._open_stores(budgets)
        self._init_attention()
        self._suspended: dict[str, float] = {}
        self._seqs: dict[int, _Seq] = {}
        # Per block id (grown on demand): tokens written per layer, pinned while incomplete,
        # and the running key-norm sum behind its magnitude signal.
        self._written = np.zeros((0, num_layers), dtype=np.int32)
        self._pinned = np.zeros(0, dtype=bool)
        self._norm_sum = np.zeros(0, dtype=np.float64)
        self._norm_count = np.zeros(0, dtype=np.int64)
        self._lost = np.zeros(0, dtype=bool)
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        # Prefix sharing: the remote tier's level-0 namespace, keyed by prefix hash (never by
        # this instance's slots, so close() leaves them), and the complete blocks (with their
        # hash) that the next step publishes.
        self._shared = self.stores["remote", 0] if config.share_prefixes else None
        self._unpublished: dict[int, int] = {}
        self._counters = {"prefix_published": 0, "prefix_fetched": 0}
        # Sequences that free_later() handed over, freed between calls.
        self._orphans: list[int] = []

    # -- configuration --------------------------------------------------------------------------

    def _budget(self, tier: str) -> int | None:
        """A tier's budget in bytes, from ``{tier}_blocks`` or ``{tier}_budget``; None: no
        such tier."""
        blocks = getattr(self.config, f"{tier}_blocks", None)
        if blocks is not None:
            return int(blocks) * self.level_bytes[0]
        budget: int | None = getattr(self.config, f"{tier}_budget")
        return budget

    def _device_budget(self) -> int:
        budget = self._budget("device")
        if budget is not None:
            return budget
        torch = torch_module()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_CUDA_SHARE)
        return DEFAULT_CPU_BYTES

    def _check_pool_sizes(self, budgets: dict[str, int]) -> None:
        """Refuses budgets the pools cannot have, before anything is allocated or opened: more
        slots than a pool can index, or tensor pools larger than the memory they live in."""
        for (tier, level), n in self.slots.items():
            if n > MAX_POOL_SLOTS:
                raise ConfigError(
                    f"{tier} budget {budgets[tier]} B makes {n} slots of "
                    f"{self.level_bytes[level]} B at level {level}, more than the "
                    f"{MAX_POOL_SLOTS} a pool can index: lower the {tier} budget or raise "
                    "block_size"
                )
        wanted: dict[str, tuple[int, list[str]]] = {}
        for (tier, level), n in self.slots.items():
            if tier not in STORE_TIERS:
                where = self.device.type if tier == "device" else "cpu"
                nbytes, tiers = wanted.get(where, (0, []))
                wanted[where] = (nbytes + n * self.level_bytes[level], [*tiers, tier])
        for where, (nbytes, tiers) in wanted.items():
            have = _memory_of(where, self.device)
            if have is not None and nbytes > have:
                names = " and ".join(dict.fromkeys(tiers))
                raise ConfigError(
                    f"{names} budget: the pools take {nbytes} B of {where} memory, allocated "
                    f"when the manager is built, but the {where} has {have} B: lower the "
                    f"{names} budget"
                )

    def _open_stores(self, budgets: dict[str, int]) -> dict[tuple[str, int], KVStore]:
        """One store per store tier, seen through one namespace per level (its codec)."""
        cfg = self.config
        stores: dict[tuple[str, int], KVStore] = {}
        for tier in (t for t in budgets if t in STORE_TIERS):
            base_ns = Namespace(cfg.namespace, codec=self.ladder[0], dtype=self.shape.dtype)
            if tier == "disk":
                if cfg.disk_path is None:
                    raise ConfigError("disk_budget: the disk tier needs a directory: set disk_path")
                # The core keeps the tier within its budget; the store's own budget only
                # allows for the headers.
                root = Path(cfg.disk_path) / f"manager-{self.instance}"
                store: KVStore = DiskStore(root, base_ns, 2 * budgets[tier])
                # Its files are this manager's slots, of no use to anyone else: a manager
                # dropped without close() (a collected TieredCache's own) takes them along.
                weakref.finalize(self, shutil.rmtree, root, ignore_errors=True)
            else:
                if cfg.remote_url is None:
                    raise ConfigError(
                        "remote_budget: the remote tier needs a server: set remote_url"
                    )
                store = RedisStore(
                    cfg.remote_url,
                    base_ns,
                    timeout=cfg.remote_timeout,
                    ttl=cfg.remote_ttl,
                    retry_after=STORE_RETRY_S,
                    tls_ca=cfg.remote_tls_ca,
                    tls_cert=cfg.remote_tls_cert,
                    tls_key=cfg.remote_tls_key,
                )
            for level, codec in enumerate(self.ladder[: len(self.codecs)]):
                stores[tier, level] = store.with_namespace(
                    base_ns.with_codec(codec, self.shape.dtype, str(self.shape))
                )
        return stores

    def close(self) -> None:
        """Deletes this manager's blocks from its disk and remote tiers and closes them. The
        tensor pools go with the object."""
        with self._step_lock, self._lock:
            for (_, level), store in self.stores.items():
                if store.closed:
                    continue
                if isinstance(store, DiskStore):
                    shutil.rmtree(store.root, ignore_errors=True)
                else:
                    # Slot keys only (instance.slot), never the published prefix hashes.
                    mine = [k for k in store.keys() if k.startswith(f"{self.instance}.")]  # noqa: SIM118
                    store.delete_many(mine)
                if level == len(self.codecs) - 1:
                    store.close()

    def __enter__(self) -> BlockManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pool_bytes(self) -> int:
        """Bytes allocated for all pools (what the manager costs, whatever it holds)."""
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    # -- sequences ------------------------------------------------------------------------------

    def add_sequence(self, token_ids: Any = None, *, salt: str | None = None) -> int:
        """A new sequence; with ``token_ids`` (its prompt), the longest cached prefix of them is
        shared rather than stored again: :meth:`num_tokens` then says how many leading tokens
        already have their K/V, and appends start after them. With ``share_prefixes``, the
        blocks that follow are taken from the remote server where another engine published
        them (one round trip).

        ``salt`` (a non-empty ``str``: a tenant id, vLLM's ``cache_salt``) keeps the sequence's
        blocks, here and on the remote server, apart from those of sequences with another salt
        or none: it shares only with sequences of the same salt (its forks keep it). Without a
        salt, the blocks' hashes and keys are those of earlier versions."""
        tokens = None if token_ids is None else _token_array(token_ids)
        with self._lock:
            self._free_orphans()
            seq = self.core.add_sequence(salt)
            state = _Seq(np.zeros(self.shape.layers, dtype=np.int64))
            self._seqs[seq] = state
            if tokens is not None and len(tokens):
                cached = len(self.core.lookup_tokens(tokens, salt))
                try:
                    self._grow(
                        seq, lambda: self.core.append_tokens(seq, tokens), len(tokens), cached
                    )
                except BaseException:
                    del self._seqs[seq]
                    self.core.free_sequence(seq)
                    raise
                state.lengths[:] = self._cached_prefix(self.core.sequence_blocks(seq))
        if self._shared is not None and tokens is not None:
            self._fetch_shared(seq)
        return seq

    def add_tokens(self, seq: int, token_ids: Any) -> None:
        """Declares the ids of tokens about to be appended (e.g. each generated token), so their
        blocks are hashed and can serve later prompts as a cached prefix. Without it, appended
        K/V is stored but never shared."""
        tokens = _token_array(token_ids)
        with self._lock:
            self._seq(seq)
            self._grow(seq, lambda: self.core.append_tokens(seq, tokens), len(tokens))

    def num_tokens(self, seq: int, layer: int = 0) -> int:
        """Tokens whose K/V ``layer`` holds for ``seq``."""
        with self._lock:
            return int(self._seq(seq).lengths[self._layer(layer)])

    def attended_tokens(self, seq: int, layer: int = 0) -> int:
        """Tokens of ``seq`` that attention still sees at ``layer``: :meth:`num_tokens` less
        those of the blocks a ``drop`` level took out (what :meth:`gather` returns)."""
        with self._lock:
            return self._attended(seq, int(self._seq(seq).lengths[self._layer(layer)]))[1]

    def sequences(self) -> list[int]:
        with self._lock:
            self._free_orphans()
            return list(self._seqs)

    def lookup(self, token_ids: Any, *, salt: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` have their K/V cached (whole blocks), for a
        sequence that :meth:`add_sequence` would add with this ``salt``. With
        ``share_prefixes``, the blocks after those that the server holds count too (one round
        trip; a value is checked only when :meth:`add_sequence` takes it, so a damaged one can
        make that take fewer)."""
        tokens = _token_array(token_ids)
        with self._lock:
            here = self._cached_prefix(self.core.lookup_tokens(tokens, salt))
        if self._shared is None:
            return here
        bs = self.block_size
        hashes = prefix_hashes(tokens, bs, self.config.namespace, salt)[here // bs :]
        found = [*self._shared.contains_many([int(h) for h in hashes]), False]
        return here + found.index(False) * bs

    def fork(self, seq: int) -> int:
        """A child sequence sharing ``seq``'s blocks (beam search, parallel sampling): full blocks
        are shared, the partial last block is copied."""
        with self._lock:
            parent = self._seq(seq)
            child, copy = self._with_room(lambda: self.core.fork(seq), 1)
            self._seqs[child] = _Seq(parent.lengths.copy())
            if copy is not None:
                src, dst = copy
                new = np.array([dst], dtype=np.uint32)
                self._track(new)
                info = self.core.block_info(np.array(copy, dtype=np.uint32))
                pool = self.pools["device", 0]
                pool[int(info["slot"][1])] = pool[int(info["slot"][0])]
                self._written[dst] = self._written[src]
                self._norm_sum[dst] = self._norm_sum[src]
                self._norm_count[dst] = self._norm_count[src]
                self._pin(new)
            return child

    def free(self, seq: int) -> None:
        """Drops a sequence. Its complete blocks stay cached for later prompts until new blocks
        need their room (``evict_on_full``, the default); blocks some layer never finished are
        forgotten, so they are never shared."""
        with self._lock:
            self._seq(seq)
            blocks = self.core.sequence_blocks(seq)
            info = self.core.block_info(blocks)
            mine = blocks[(info["refcount"] == 1) & self._pinned[blocks]]
            if len(mine):
                self.core.unpin(mine)
                self._pinned[mine] = False
                self.core.forget(mine)
            self.core.free_sequence(seq)
            del self._seqs[seq]

    def free_later(self, seqs: Iterable[int]) -> None:
        """Frees ``seqs`` at the manager's next :meth:`add_sequence`, :meth:`step`,
        :meth:`stats` or :meth:`sequences` (or when appends need room). Safe where :meth:`free` is not: in a finalizer, which a garbage
        collector may run inside any call of this manager in the same thread."""
        self._orphans.extend(seqs)

    def _free_orphans(self) -> None:
        """Frees what :meth:`free_later` was given; called holding the lock, between calls."""
        while self._orphans:
            seq = self._orphans.pop()
            if seq in self._seqs:
                self.free(seq)

    # -- K/V ------------------------------------------------------------------------------------

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Appends K/V of new tokens, ``[num_tokens, num_kv_heads, head_dim]`` each, to one layer
        of ``seq``. The first layer to pass the sequence's end allocates its blocks; when the
        device is full, a plan demotes and offloads to make room, then cached blocks are
        evicted (``evict_on_full``), and only when the live sequences do not fit does
        :class:`OutOfCapacityError` say so. Everything is checked before anything changes:
        shape, dtype, device, finite values (NaN or inf in K or V is refused), sequence, layer
        and room; a call that raises leaves the K/V, the pools and the counters as they were,
        so a retry with good K/V stores it. K/V that require grad are stored detached."""
        if self._pool0 and self._append_one(seq, layer, k, v):
            return
        k, v = self._check_kv(k, "k"), self._check_kv(v, "v")
        if k.shape != v.shape:
            raise InvalidArgumentError(
                f"expected k and v of one shape, got {list(k.shape)} and {list(v.shape)}"
            )
        layer = self._layer(layer)
        # A cache holds values: gradients do not flow into it.
        k, v = k.detach(), v.detach()
        norms = _key_norms(k, v)
        n = int(k.shape[0])
        with self._lock:
            state = self._seq(seq)
            start = int(state.lengths[layer])
            end = start + n
            if n == 0:
                return
            have = self.core.sequence_tokens(seq)
            if start < have:
                self._check_writable(seq, layer, start, min(end, have))
            if end > have:
                self._grow(seq, lambda: self.core.extend(seq, end - have), end - have)
            self._write(seq, layer, start, end, k, v, norms)
            state.lengths[layer] = end

    def gather(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token of ``seq`` at ``layer``, ``[num_tokens, num_kv_heads,
        head_dim]`` each, decoded to the model dtype, contiguous, on the device. Counts a read
        of each block for the scheduler. Under a ladder with a ``drop`` level, the tokens of
        dropped blocks are left out (fewer than :meth:`num_tokens`, in order; the sink blocks,
        the recent window and the newest block are never dropped, so the newest tokens are
        always the last)."""
        tokens, blocks = self._gather_blocks(seq, layer)
        m, bs = blocks.shape[0], self.block_size
        kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, m * bs, *self.shape.dims[2:5:2])
        # One block reshapes to a strided view, not a copy: contiguous as promised.
        return kv[0, :tokens].contiguous(), kv[1, :tokens].contiguous()

    def gather_blocks(self, seq: int, layer: int) -> torch.Tensor:
        """The blocks of ``seq`` at ``layer`` as stored, decoded to the model dtype, on the
        device: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]`` (K then V), the last
        block possibly partial (its rows past :meth:`num_tokens` undefined). For engines whose
        own cache is paged: no token-major copy on the way. Counts a read of each block.
        Dropped blocks (a ``drop`` level) are left out, as :meth:`gather` leaves them."""
        return self._gather_blocks(seq, layer)[1]

    def _gather_blocks(self, seq: int, layer: int) -> tuple[int, torch.Tensor]:
        torch = torch_module()
        layer = self._layer(layer)
        bs = self.block_size
        with self._lock:
            blocks, tokens = self._attended(seq, int(self._seq(seq).lengths[layer]))
            m = len(blocks)
            need = np.minimum(bs, tokens - bs * np.arange(m))
            short = np.nonzero(self._written[blocks, layer] < need)[0]
            if len(short):
                raise InvalidArgumentError(
                    f"sequence {seq} layer {layer}: block {int(blocks[short[0]])} (tokens from "
                    f"{int(short[0]) * bs}) is shared but its owner has not written this layer "
                    "yet; append the owner's layer first"
                )
            self._check_not_lost(seq, blocks)
            out = torch.empty((m, *self.shape.dims[1:]), dtype=self.dtype, device=self.device)
            for (tier, level), rows, slots, ids in self._locations(blocks):
                try:
                    part = self._read_layer(tier, level, slots, layer, ids)
                except _Lost as exc:
                    self._mark_lost(exc.blocks.astype(np.uint32))
                    self._check_not_lost(seq, blocks)
                    raise
                out.index_copy_(0, rows, part)
            if m:
                self.core.record_reads(blocks)
        return tokens, out

    def attend(
        self,
        seqs: int | Sequence[int],
        layer: int,
        q: Any,
        *,
        scale: float | None = None,
        record: bool = True,
        return_mass: bool = False,
    ) -> Any:
        """Attention output of the newest queries of ``seqs`` at ``layer``, computed over their
        blocks where they lie: level-0 blocks read as they are, INT8/INT4 blocks dequantized a
        tile at a time inside the kernel (the Rust CPU kernel, or the CUDA kernel), never
        gathered into a full-precision copy.

        ``q``: ``[queries, q_heads, head_dim]`` for one sequence, or ``[len(seqs), queries,
        q_heads, head_dim]`` for several, in the model dtype on the device; ``q_heads`` a
        multiple of the K/V heads (grouped-query attention). The queries are each sequence's
        last ``queries`` tokens, whose K/V :meth:`append` has already stored; query ``i`` sees
        the keys up to its own position (causal, so a prefill chunk over a cached prefix works
        too). ``scale``: the softmax scale (default ``head_dim ** -0.5``). Returns the output,
        shaped and typed like ``q`` (with ``return_mass``: ``(output, mass)``, ``mass`` fp32
        ``[len(seqs), max_blocks]`` numpy, each block's share of the attention, averaged over
        heads and queries). ``record``: the masses feed the scheduler's attention signal (as
        :meth:`record_attention` does) and each block counts as read, as :meth:`gather`
        counts it."""
        torch = torch_module()
        single, ids = _sequence_ids(seqs)
        q = as_tensor(q, "q")
        D = self.shape.head_dim
        # One sequence takes [Q, Hq, D] (or [1, Q, Hq, D]); the kernels read either alike.
        dims = tuple(q.shape) if q.dim() == 4 or not single else (1, *q.shape)
        if len(dims) != 4 or dims[0] != len(ids) or dims[3] != D:
            raise InvalidArgumentError(
                f"q: expected [queries, q_heads, {D}] for one sequence or [{len(ids)} sequences, "
                f"queries, q_heads, {D}], got {list(q.shape)}"
            )
        if dims[2] % self.shape.kv_heads:
            raise InvalidArgumentError(
                f"q: {dims[2]} query heads is not a multiple of the {self.shape.kv_heads} K/V heads"
            )
        if q.dtype is not self.dtype or q.device != self.device:
            raise InvalidArgumentError(
                f"q: expected {self.dtype} on {self.device}, got {q.dtype} on {q.device}"
            )
        sm_scale = D**-0.5 if scale is None else _softmax_scale(scale)
        # A NaN or inf query would leave the kernels a row of zeros that looks like an answer
        # (and zero mass for the scheduler): refused, as append refuses non-finite K/V.
        if not all_finite(q):
            raise InvalidArgumentError(
                "q: expected finite values, got NaN or inf; nothing was computed or recorded"
            )
        layer = self._layer(layer)
        queries, bs = dims[1], self.block_size
        q = q.detach()
        if not q.is_contiguous():
            q = q.contiguous()
        with self._lock:
            tokens = [int(self._seq(s).lengths[layer]) for s in ids]
            if tokens and min(tokens) < max(queries, 1):
                raise InvalidArgumentError(
                    f"q: {queries} queries, but a sequence holds {min(tokens)} tokens at layer "
                    f"{layer}: append the queries' K/V first"
                )
            counts = [-(-n // bs) for n in tokens]
            lengths = np.array(tokens, dtype=np.int32)
            batch = self._attention_batch(ids, counts)
            batch.check(self, ids, tokens, layer, queries)
            pools, slots, views, desc = batch.pools, batch.slots, self._attend_views, None
            if batch.staged:
                pools, slots = pools.copy(), slots.copy()
                try:
                    views = self._stage(batch, pools, slots, layer)
                except _Lost as exc:  # a store could not give a block back: never wrong K/V
                    self._mark_lost(exc.blocks.astype(np.uint32))
                    for seq, blocks in zip(ids, batch.blocks, strict=True):
                        self._check_not_lost(seq, blocks)
                    raise
                desc = np.concatenate([self._attend_desc, describe(views[-1:], self.shape)])
            out = torch.empty_like(q)
            mass = np.zeros(pools.shape, dtype=np.float32)
            run_attention(
                q, out, mass, lengths, pools, slots, views, self.shape, layer, sm_scale,
                self._attend_desc if desc is None else desc,
            )  # fmt: skip
            if record and pools.shape[1]:
                if single:
                    blocks, masses = batch.blocks[0][: counts[0]], mass[0, : counts[0]]
                else:
                    blocks = np.concatenate(
                        [b[:n] for b, n in zip(batch.blocks, counts, strict=True)]
                    )
                    masses = mass[np.arange(pools.shape[1])[None, :] < np.array(counts)[:, None]]
                self.core.record_attention(blocks, masses)
                self.core.record_reads(blocks)
        return (out, mass) if return_mass else out

    def _attention_batch(self, ids: tuple[int, ...], counts: list[int]) -> _AttentionBatch:
        """Where the blocks of ``ids`` lie for the kernels (the first ``counts`` of each at
        least), kept until blocks move (the epoch changes) or a sequence outgrows it: a decode
        step reads it for every layer."""
        batch = self._attention_batches.get(ids)
        if (
            batch is None
            or batch.epoch != self._epoch
            or any(n > have for n, have in zip(counts, batch.counts, strict=True))
        ):
            if len(self._attention_batches) >= 8 or (batch and batch.epoch != self._epoch):
                self._attention_batches.clear()
            batch = _AttentionBatch.build(self, ids)
            self._attention_batches[ids] = batch
        return batch

    def _stage(
        self, batch: _AttentionBatch, pools: np.ndarray, slots: np.ndarray, layer: int
    ) -> list[PoolView]:
        """The attention pools plus a staging pool holding ``layer`` of the blocks the kernels
        cannot read where they lie (a store tier, a codec without a kernel, host memory behind
        a GPU), decoded; ``pools``/``slots`` are pointed at it."""
        staged = np.nonzero(pools == -2)
        blocks = np.array(
            [batch.blocks[r][j] for r, j in zip(*staged, strict=True)], dtype=np.uint32
        )
        torch = torch_module()
        stage = torch.empty(
            (len(blocks), 1, *self.shape.dims[1:]), dtype=self.dtype, device=self.device
        )
        for (tier, level), rows, where, ids in self._locations(blocks):
            stage[rows, 0] = self._read_layer(tier, level, where, layer, ids)
        pools[staged] = len(self._attend_views)
        slots[staged] = np.arange(len(blocks), dtype=np.int32)
        return [*self._attend_views, PoolView(stage, IdentityCodec(self.shape.dtype), 0)]

    # -- signals --------------------------------------------------------------------------------

    def record_attention(self, seq: int, layer: int, weights: Any) -> None:
        """Feeds attention weights whose last axis runs over the sequence's tokens (e.g.
        ``[heads, queries, tokens]`` from eager attention; the tokens :meth:`gather` returns,
        so without those of dropped blocks). Each block is credited the attention
        *mass* it received: the weights are averaged over the leading axes (so a prefill's many
        queries weigh no more than one decode step's), then summed over the block's tokens, as
        H2O accumulates attention. The core smooths these masses over reports."""
        w = as_tensor(weights, "weights")
        layer = self._layer(layer)
        with self._lock:
            tokens = int(self._seq(seq).lengths[layer])
            blocks, tokens = self._attended(seq, tokens)  # weights over what gather returned
            if w.dim() < 1 or w.shape[-1] != tokens:
                raise InvalidArgumentError(
                    f"weights: expected a last axis of {tokens} tokens (sequence {seq}, layer "
                    f"{layer}), got shape {list(w.shape)}"
                )
            per_token = w.detach().float().reshape(-1, tokens).mean(0).cpu().numpy()
            mass = _per_block(per_token, self.block_size)
            self.core.record_attention(blocks, mass.astype(np.float32))

    def set_learned_scores(self, seq: int, scores: Any, first_block: int = 0) -> None:
        """A learned importance score per block of ``seq`` (e.g. from a probe on its keys),
        from its block ``first_block`` on (default: every block)."""
        values = np.asarray(scores, dtype=np.float32).reshape(-1)
        with self._lock:
            blocks = self.core.sequence_blocks(self._seq_id(seq))
            if not 0 <= first_block <= len(blocks):
                raise InvalidArgumentError(
                    f"first_block: expected 0 to {len(blocks)} (sequence {seq} has {len(blocks)} "
                    f"blocks), got {first_block}"
                )
            blocks = blocks[first_block:]
            if len(values) != len(blocks) or not np.isfinite(values).all():
                raise InvalidArgumentError(
                    f"scores: expected {len(blocks)} finite scores (one per block of sequence "
                    f"{seq} from block {first_block}), got {len(values)}"
                )
            self.core.set_learned(blocks, values)

    # -- scheduling -----------------------------------------------------------------------------

    def step(self, room_bytes: int = 0) -> dict[str, int]:
        """Lets the core plan moves and executes them: one batched codec call or copy per kind of
        move and pair of pools, then commit. If a copy fails, the plan is aborted (every block
        stays where it was) and the error raised; a store tier that refuses or loses blocks is
        handled instead (see the module doc) and the summary says so. Returns the plan's
        summary. ``room_bytes``: also free that much of the device budget for blocks about to be
        allocated."""
        with self._step_lock:
            if self._unpublished:
                self._publish()
            with self._lock:
                self._free_orphans()
                self._resume_stores()
                plan = self.core.plan(room_bytes)
            return self._run(plan)

    def _run(self, plan: Plan) -> dict[str, int]:
        """Executes a plan and commits it (aborts it if a copy fails); called holding the step
        lock, not the lock."""
        try:
            self._execute(plan)
        except (_StoreRefused, _Lost) as exc:
            with self._lock:
                self.core.abort(plan.id, copied=True)  # some copies may have run
                return {**plan.summary(), **self._store_failed(exc)}
        except BaseException:
            with self._lock:
                self.core.abort(plan.id, copied=True)
            raise
        with self._lock:
            self.core.commit(plan.id)
            self._epoch += 1  # blocks moved: attention tables are stale
        return plan.summary()

    def _execute(self, plan: Plan) -> None:
        if not len(plan):
            return
        torch = torch_module()
        tiers, kinds = Plan.TIERS, Plan.KINDS
        copies = np.isin(plan.kind, [kinds.index("evict"), kinds.index("drop")], invert=True)
        cols = np.stack([plan.src_tier, plan.src_level, plan.dst_tier, plan.dst_level]).T[copies]
        blocks = plan.block[copies]
        src_slots, dst_slots = plan.src_slot[copies], plan.dst_slot[copies]
        groups, inverse = np.unique(cols, axis=0, return_inverse=True)
        for g, (st, sl, dt, dl) in enumerate(groups):
            pick = inverse.reshape(-1) == g
            src_key, dst_key = (tiers[st], int(sl)), (tiers[dt], int(dl))
            src, s = self._source(src_key, src_slots[pick], blocks[pick])
            dst, d = self._destination(dst_key, dst_slots[pick])
            if sl == dl:
                dst[d.to(dst.device)] = src[s.to(src.device)].to(dst.device, non_blocking=True)
            elif st == dt and sl == 0:
                self.codecs[dl].encode_into(src, s, dst, d)
            elif st == dt:
                self.codecs[sl].transcode_into(src, s, self.codecs[dl], dst, d, self.shape)
            else:
                raise RuntimeError(f"plan moves a block across tiers and levels at once: {cols}")
            if dst_key in self.stores:
                self._store_rows(dst_key, dst_slots[pick], dst)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- prefix sharing -------------------------------------------------------------------------

    def _publish(self) -> None:
        """Puts the blocks completed since the last step on the remote server, each under its
        prefix hash. They have stayed pinned at level 0 on the device since then, so their pool
        rows are sent as they are (on the CPU without a copy), outside the lock. A failed put
        costs the sharing only."""
        torch = torch_module()
        with self._lock:
            queued, self._unpublished = self._unpublished, {}
            blocks = np.fromiter(queued, dtype=np.uint32, count=len(queued))
            slots = torch.from_numpy(self.core.block_info(blocks)["slot"].astype(np.int64))
        try:
            pool = self.pools["device", 0]
            if pool.device.type == "cpu":
                rows = [pool[s].view(-1).view(torch.uint8).numpy() for s in slots.tolist()]
            else:
                host = pool.index_select(0, slots.to(pool.device)).cpu()
                rows = list(host.reshape(len(slots), -1).view(torch.uint8).numpy())
            assert self._shared is not None
            done = self._shared.put_many(list(queued.values()), rows)
        finally:
            with self._lock:
                self.core.unpin(blocks)
        self._counters["prefix_published"] += sum(done)

    def _fetch_shared(self, seq: int) -> None:
        """Fills the leading blocks of a new sequence's prompt that this manager lacks from what
        other engines published (a value that fails its checks is a miss, so the engine computes
        that block and the rest). The server is asked outside the lock: nobody else knows the
        sequence yet, and its unwritten blocks stay pinned where they are."""
        torch = torch_module()
        bs = self.block_size
        with self._lock:
            first = int(self._seqs[seq].lengths[0]) // bs
            blocks = self.core.sequence_blocks(seq)[first:]
            hashes = self.core.block_info(blocks)["hash"]
            n = len(hashes) if hashes.all() else int(np.argmin(hashes != 0))
            blocks, hashes = blocks[:n], hashes[:n]
        if not n:
            return
        assert self._shared is not None
        values = self._shared.get_many([int(h) for h in hashes])
        hits: list[memoryview] = []
        for v in values:
            if v is None or len(v) != self.level_bytes[0]:
                break
            hits.append(v)
        if not hits:
            return
        with self._lock:
            blocks = blocks[: len(hits)]
            untouched = (self._written[blocks] == 0).all(axis=1) & self._pinned[blocks]
            k = len(blocks) if untouched.all() else int(np.argmin(untouched))
            if not k:
                return
            blocks, hits = blocks[:k], hits[:k]
            slots = self.core.block_info(blocks)["slot"].astype(np.int64)
            pool = self.pools["device", 0]
            if pool.device.type == "cpu":
                # Block by block, each value straight into its row, whose keys' norms are then
                # taken while the row is in cache (2.5x faster than whole-batch passes).
                sums = np.empty(k)
                for i, (slot, value) in enumerate(zip(slots.tolist(), hits, strict=True)):
                    row = pool[slot]
                    row.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(value, np.uint8)
                    sums[i] = float(_key_norm_sums(row[None])[0])
            else:
                rows = self._rows(hits, 0).to(self.device)
                pool[torch.from_numpy(slots).to(self.device)] = rows
                sums = _key_norm_sums(rows).cpu().numpy()
            self._written[blocks] = bs
            # The magnitude signal as appends would have left it (the mean over heads of each
            # token's key norm, averaged over the block's tokens and layers).
            self._norm_sum[blocks] = sums
            self._norm_count[blocks] = self.shape.layers * bs
            self.core.set_magnitude(
                blocks, (self._norm_sum[blocks] / self._norm_count[blocks]).astype(np.float32)
            )
            self.core.unpin(blocks)
            self._pinned[blocks] = False
            self._counters["prefix_fetched"] += k
            state = self._seqs[seq]
            state.lengths[:] = self._cached_prefix(self.core.sequence_blocks(seq))

    # -- store tiers ----------------------------------------------------------------------------

    def _slot_keys(self, slots: np.ndarray) -> list[str]:
        return [f"{self.instance}.{int(s)}" for s in slots]

    def _row_shape(self, level: int) -> tuple[int, ...]:
        return tuple(self.shape.dims) if level == 0 else (self.level_bytes[level],)

    def _load(self, key: tuple[str, int], slots: np.ndarray, blocks: np.ndarray) -> torch.Tensor:
        """Rows of a store pool as a CPU tensor ``[n, *row]``; raises :class:`_Lost` naming the
        blocks the store could not give back."""
        level = key[1]
        values = self.stores[key].get_many(self._slot_keys(slots))
        nbytes = self.level_bytes[level]
        got = [v for v in values if v is not None and len(v) == nbytes]
        if len(got) < len(values):
            lost = [i for i, v in enumerate(values) if v is None or len(v) != nbytes]
            raise _Lost(key[0], blocks[lost])
        return self._rows(got, level)

    def _rows(self, values: list[memoryview], level: int) -> torch.Tensor:
        """Values of a level's size as a CPU tensor of its rows, ``[n, *row]``."""
        torch = torch_module()
        raw = np.empty((len(values), self.level_bytes[level]), dtype=np.uint8)
        for i, v in enumerate(values):
            raw[i] = np.frombuffer(v, np.uint8)
        rows = torch.from_numpy(raw)
        if level == 0:
            rows = rows.view(self.dtype)
        return rows.reshape(len(values), *self._row_shape(level))

    def _source(
        self, key: tuple[str, int], slots: np.ndarray, blocks: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a group of moves reads: a tensor pool and the slots, or a store's rows loaded."""
        torch = torch_module()
        if key in self.stores:
            return self._load(key, slots, blocks), torch.arange(len(slots))
        return self.pools[key], torch.from_numpy(slots.astype(np.int64))

    def _destination(
        self, key: tuple[str, int], slots: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a group of moves writes: a tensor pool and the slots, or rows that
        :meth:`_store_rows` then puts."""
        torch = torch_module()
        if key in self.stores:
            dt = self.dtype if key[1] == 0 else torch.uint8
            rows = torch.empty((len(slots), *self._row_shape(key[1])), dtype=dt)
            return rows, torch.arange(len(slots))
        return self.pools[key], torch.from_numpy(slots.astype(np.int64))

    def _store_rows(self, key: tuple[str, int], slots: np.ndarray, rows: torch.Tensor) -> None:
        torch = torch_module()
        raw = rows.reshape(len(slots), -1).contiguous().view(torch.uint8).numpy()
        done = self.stores[key].put_many(self._slot_keys(slots), list(raw))
        if not all(done):
            raise _StoreRefused(key[0])

    def _store_failed(self, exc: _StoreRefused | _Lost) -> dict[str, int]:
        """After a plan was aborted for a store: a refusing tier sits out a while; lost blocks
        are forgotten (so never shared) and pinned where they are (so never moved again)."""
        if isinstance(exc, _StoreRefused):
            used = dict(self.core.tier_bytes())[exc.tier]
            self.core.set_budget(exc.tier, used)
            self._suspended[exc.tier] = time.monotonic() + STORE_RETRY_S
            log.warning("the %s tier refused a write: no moves into it for a while", exc.tier)
            return {"store_refused": 1}
        lost = exc.blocks.astype(np.uint32)
        self._mark_lost(lost)
        log.warning("%d block(s) lost from the %s tier", len(lost), exc.tier)
        return {"lost": len(lost)}

    def _mark_lost(self, blocks: np.ndarray) -> None:
        self._epoch += 1
        self.core.forget(blocks)
        live = blocks[self.core.block_info(blocks)["refcount"] > 0]
        self.core.pin(live)
        self._pinned[live] = True
        self._lost[live] = True

    def _resume_stores(self) -> None:
        now = time.monotonic()
        for tier, until in list(self._suspended.items()):
            if now >= until:
                self.core.set_budget(tier, self._tier_budget(tier))
                del self._suspended[tier]

    def _tier_budget(self, tier: str) -> int:
        return sum(self.slots[tier, lv] * b for lv, b in enumerate(self.level_bytes))

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> ManagerStats:
        """Pool occupancy, bytes saved and move counters, read from the core."""
        with self._lock:
            self._free_orphans()
            dropped = self._dropped_blocks()
            pools = tuple(
                PoolStats(
                    tier=tier,
                    level=level,
                    codec=self.ladder[level],
                    # a drop level holds no slots: it counts the blocks out of attention
                    blocks=dropped if level == self.drop_level and tier == "device" else used,
                    capacity_blocks=cap,
                    bytes=nbytes,
                    capacity_bytes=cap * self.level_bytes[level],
                )
                for tier, level, used, cap, nbytes in self.core.usage()
            )
            tokens = sum(int(s.lengths.max(initial=0)) for s in self._seqs.values())
            return ManagerStats(
                pools=pools,
                held_bytes=sum(p.bytes for p in pools),
                level0_bytes=sum(p.blocks for p in pools) * self.level_bytes[0],
                counters={**self.core.counters(), **self._counters},
                sequences=len(self._seqs),
                tokens=tokens,
            )

    def _dropped_blocks(self) -> int:
        """Blocks of live sequences that a ``drop`` level took out of attention."""
        if self.drop_level is None or not self._seqs:
            return 0
        blocks = np.unique(np.concatenate([self.core.sequence_blocks(s) for s in self._seqs]))
        return int((self.core.block_info(blocks)["level"] == self.drop_level).sum())

    def get_compression_stats(self) -> dict[str, Any]:
        """``memory_saved_mb``, ``avg_compression_ratio``, per-pool blocks and bytes, and the
        promotions, demotions, offloads, evictions and hits so far (see :class:`ManagerStats`)."""
        return self.stats().as_dict()

    # -- internals ------------------------------------------------------------------------------

    def _init_attention(self) -> None:
        """What :meth:`attend` and one-token appends need, set up once: the pools the attention
        kernels read where they lie (device pools, and host pools when the device is the CPU)
        and, per (tier, level), the index of that pool among them (-2: staged)."""
        readable_tiers = ("device",) if self.device.type == "cuda" else ("device", "host")
        self._attend_views: list[PoolView] = []
        self._attend_lut = np.full((len(Plan.TIERS), len(self.ladder)), -2, dtype=np.int32)
        for (tier, level), pool in self.pools.items():
            if tier in readable_tiers and readable(self.codecs[level]):
                self._attend_lut[Plan.TIERS.index(tier), level] = len(self._attend_views)
                self._attend_views.append(PoolView(pool, self.codecs[level]))
        if self.drop_level is not None:
            self._attend_lut[:, self.drop_level] = -1  # out of attention: the kernels skip it
        self._attend_desc = describe(self._attend_views, self.shape)
        self._attention_batches: dict[tuple[int, ...], _AttentionBatch] = {}
        # Bumped whenever blocks move or sequences grow: the attention tables' validity.
        self._epoch = 0
        # One-token appends on the CPU are written by the extension (_core.write_token) at the
        # address of the level-0 pool (0: not on the CPU).
        pool0 = self.pools["device", 0]
        self._pool0 = pool0.data_ptr() if self.device.type == "cpu" else 0
        self._item = pool0.element_size()
        self._token_type = type(pool0)
        self._token_shape = torch_module().Size((1, self.shape.kv_heads, self.shape.head_dim))
        self._dtype_code = FLOAT_CODES[self.shape.dtype]

    def _append_one(self, seq: int, layer: Any, k: Any, v: Any) -> bool:
        """The decode step's append on the CPU: one token into the block this sequence is
        filling, its checks inlined (this runs once per layer per token). False, with nothing
        done, whenever the general path must run: another shape or kind of input, a new block
        needed, or not the next token of a block being filled."""
        tensor = self._token_type
        if not (
            type(k) is tensor
            and type(v) is tensor
            and k.shape == self._token_shape
            and v.shape == self._token_shape
            and k.dtype is self.dtype
            and v.dtype is self.dtype
            and k.is_cpu
            and v.is_cpu
            and k.stride(1) == v.stride(1)  # the token axis has one element: any stride
            and k.stride(2) == 1 == v.stride(2)
            and type(layer) is int
            and 0 <= layer < self.shape.layers
        ):
            return False
        bs = self.block_size
        with self._lock:
            state = self._seqs.get(seq)
            if state is None:
                return False
            start = int(state.lengths[layer])
            index, off = divmod(start, bs)
            grows = start == self.core.sequence_tokens(seq)  # this layer is the first there
            if grows and off == 0:
                return False  # a new block first
            tail = state.tail
            if tail is None or tail[0] != index:
                block = int(self.core.sequence_blocks(seq)[index])
                info = self.core.block_info(np.array([block], dtype=np.uint32))
                if info["tier"][0] != 0 or info["level"][0] != 0 or not self._pinned[block]:
                    return False
                tail = state.tail = (index, block, int(info["slot"][0]))
            _, block, slot = tail
            if not self._pinned[block] or self._lost[block] or self._written[block, layer] != off:
                return False
            H, D, item = self.shape.kv_heads, self.shape.head_dim, self._item
            # K of head 0 at [slot, layer, 0, 0, off]; V half a layer's row further on.
            k_at = (
                self._pool0 + (((slot * self.shape.layers + layer) * 2 * H * bs) + off) * D * item
            )
            norm, bad = write_token(
                k_at, k_at + H * bs * D * item, bs * D, k.data_ptr(), v.data_ptr(), k.stride(1),
                H, D, self._dtype_code,
            )  # fmt: skip
            if bad:
                raise InvalidArgumentError(
                    f"{'kv'[bad - 1]}: expected finite values, got NaN or inf; nothing was stored"
                )
            if grows:
                self.core.extend(seq, 1)  # room in the block being filled: allocates nothing
            self._written[block, layer] = off + 1
            self._norm_sum[block] += norm
            self._norm_count[block] += 1
            state.lengths[layer] = start + 1
            if layer == self.shape.layers - 1 or off + 1 == bs:
                one = np.array([block], dtype=np.uint32)
                self.core.set_magnitude(
                    one, np.array([self._norm_sum[block] / self._norm_count[block]], np.float32)
                )
                if off + 1 == bs and (self._written[block] == bs).all():
                    self._finish(one)
        return True

    def _seq(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except (KeyError, TypeError):
            raise InvalidSequenceError(
                f"unknown sequence {seq!r}: expected one returned by add_sequence or fork and "
                "not yet freed"
            ) from None

    def _seq_id(self, seq: int) -> int:
        self._seq(seq)
        return seq

    def _layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InvalidArgumentError(f"layer: expected an int, got {type(layer).__name__}")
        if not 0 <= layer < self.shape.layers:
            raise InvalidArgumentError(
                f"layer: expected 0 <= layer < {self.shape.layers}, got {layer}"
            )
        return int(layer)

    def _check_kv(self, x: Any, what: str) -> torch.Tensor:
        t = as_tensor(x, what)
        want = (self.shape.kv_heads, self.shape.head_dim)
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise InvalidArgumentError(
                f"{what}: expected shape [num_tokens, {want[0]} kv_heads, {want[1]} head_dim], "
                f"got {list(t.shape)}"
            )
        if t.dtype != self.dtype:
            raise InvalidArgumentError(
                f"{what}: expected dtype {self.dtype} (the model dtype of this manager), got "
                f"{t.dtype}"
            )
        if t.device != self.device:
            raise InvalidArgumentError(
                f"{what}: expected a tensor on {self.device}, got one on {t.device}"
            )
        return t

    def _grow(self, seq: int, call: Callable[[], Any], tokens: int, shared: int = 0) -> None:
        """Runs a core call that allocates blocks for ``tokens`` more tokens of ``seq`` (of
        which the first ``shared`` blocks may come from the prefix cache) and tracks the new
        blocks, pinned until complete."""
        have = len(self.core.sequence_blocks(seq))
        total = -(-(self.core.sequence_tokens(seq) + tokens) // self.block_size)
        added, is_shared = self._with_room(call, max(0, total - have - shared))
        new = added[~is_shared]
        self._track(new)
        self._pin(new)
        self._epoch += 1  # the sequence has new blocks: its attention table is stale

    def _with_room(self, call: Callable[[], _T], blocks: int) -> _T:
        """Runs a core call that needs at most ``blocks`` new level-0 blocks on the device. When
        they do not fit: a plan demotes and offloads to make room (run only if it, with the
        cached blocks an eviction may take, makes enough; else aborted, nothing moved), then
        the call is retried, evicting cached blocks lowest-ranked first when ``evict_on_full``.
        If it still fails, :class:`OutOfCapacityError` says what holds the device, and nothing
        changed but the count of the aborted plan. Called with the lock held."""
        try:
            return call()
        except OutOfCapacityError:
            pass
        if self._orphans:
            self._free_orphans()
            with contextlib.suppress(OutOfCapacityError):
                return call()
        self._lock.release()  # the step lock comes first: never wait for it holding this one
        try:
            self._make_room(blocks)
        finally:
            self._lock.acquire()
        self.core.evict_on_full = self.config.evict_on_full
        try:
            return call()
        except OutOfCapacityError:
            raise OutOfCapacityError(self._full(blocks)) from None
        finally:
            self.core.evict_on_full = False

    def _make_room(self, blocks: int) -> None:
        """Runs a plan that frees ``blocks`` level-0 device slots by demoting and offloading,
        if it (with the cached blocks an eviction may then take) frees enough."""
        with self._step_lock:
            if self._unpublished:
                self._publish()
            with self._lock:
                self._resume_stores()
                # The plan may evict cached leaves for the room (into whose slots blocks of
                # level 0 go) as far as the config allows eviction at all.
                self.core.evict_on_full = self.config.evict_on_full
                try:
                    plan = self.core.plan(blocks * self.level_bytes[0])
                finally:
                    self.core.evict_on_full = False
                if self._slots_after(plan) < blocks:
                    self.core.abort(plan.id)
                    return
            self._run(plan)

    def _slots_after(self, plan: Plan) -> int:
        """Level-0 device slots free once ``plan`` commits, counting the cached blocks an
        eviction may take then (with ``evict_on_full``)."""
        device = Plan.TIERS.index("device")
        _, _, used, cap, _ = self._pool_usage("device", 0)
        # Every move out of the pool but a backup (a copy) frees its slot.
        leaving = (plan.src_tier == device) & (plan.src_level == 0)
        leaving &= plan.kind != Plan.KINDS.index("backup")
        free = cap - used + int(leaving.sum())
        if self.config.evict_on_full:
            free += next(n for t, lv, n, _ in self.core.reclaimable() if (t, lv) == ("device", 0))
        return free

    def _pool_usage(self, tier: str, level: int) -> tuple[str, int, int, int, int]:
        return next(u for u in self.core.usage() if u[:2] == (tier, level))

    def _full(self, blocks: int) -> str:
        """Why ``blocks`` new level-0 blocks do not fit: what the live sequences and the cached
        blocks hold on the device, against its budget and its level-0 slots."""
        live = np.unique(
            np.concatenate(
                [self.core.sequence_blocks(s) for s in self._seqs] + [np.zeros(0, np.uint32)]
            )
        )
        info = self.core.block_info(live)
        on_device = info["tier"] == Plan.TIERS.index("device")
        level_bytes = np.asarray(self.level_bytes, dtype=np.int64)
        live_bytes = int(level_bytes[info["level"][on_device]].sum())
        live0 = int((on_device & (info["level"] == 0)).sum())
        device_bytes = dict(self.core.tier_bytes())["device"]
        _, _, used0, cap0, _ = self._pool_usage("device", 0)
        cached_bytes, cached0 = device_bytes - live_bytes, used0 - live0
        behind = self._tiers[1:]
        if cached_bytes and not self.config.evict_on_full:
            why = "the device is full and evict_on_full is off, so its cached blocks are kept"
            fix = "set evict_on_full, free sequences, or raise device_budget/device_blocks"
        elif behind:
            # Complete live blocks go to the tiers behind the device when room is needed, so
            # what is left on it is what they could not take.
            why = f"the live sequences do not fit in the device and {'/'.join(behind)} tiers"
            fix = f"free sequences, or raise device_budget/device_blocks or the {behind[0]} budget"
        else:
            why = "the live sequences do not fit on the device"
            fix = "free sequences, or raise device_budget/device_blocks (or add a host tier)"
        return (
            f"{why}: {blocks} more level-0 block(s) of {self.level_bytes[0]} B needed; live "
            f"sequences hold {live_bytes} B there ({live0} of the {cap0} level-0 slots, where "
            f"new K/V goes), cached blocks {cached_bytes} B ({cached0} level-0 slots), device "
            f"budget {self._tier_budget('device')} B; {fix}"
        )

    def _track(self, new: np.ndarray) -> None:
        if not len(new):
            return
        top = int(new.max()) + 1
        if top > len(self._pinned):
            grow = max(top, 2 * len(self._pinned))
            self._written = np.concatenate(
                [self._written, np.zeros((grow - len(self._written), self.shape.layers), np.int32)]
            )
            for name in ("_pinned", "_norm_sum", "_norm_count", "_lost"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros(grow - len(old), old.dtype)]))
        self._written[new] = 0
        self._lost[new] = False
        self._norm_sum[new] = 0.0
        self._norm_count[new] = 0

    def _pin(self, new: np.ndarray) -> None:
        if len(new):
            self.core.pin(new)
            self._pinned[new] = True

    def _cached_prefix(self, blocks: np.ndarray) -> int:
        """Tokens of the leading blocks that are complete in every layer."""
        if not len(blocks):
            return 0
        complete = (self._written[blocks] == self.block_size).all(axis=1)
        n = len(complete) if complete.all() else int(np.argmin(complete))
        return n * self.block_size

    def _check_writable(self, seq: int, layer: int, start: int, stop: int) -> None:
        """Raises unless each token of ``[start, stop)`` (of blocks the sequence has) that is
        still to be written lies in a block at level 0 on the device, where appends write."""
        if stop <= start:
            return
        bs = self.block_size
        blocks = self.core.sequence_blocks(seq)[start // bs : (stop - 1) // bs + 1]
        if self._pinned[blocks].all():
            return  # pinned blocks never move (the usual case: the block being filled)
        positions = np.arange(start, stop)
        blocks = blocks[positions // bs - start // bs]
        fresh = blocks[(positions % bs >= self._written[blocks, layer]) & ~self._pinned[blocks]]
        if not len(fresh):
            return
        fresh = np.unique(fresh)
        info = self.core.block_info(fresh)
        moved = (info["tier"] != 0) | (info["level"] != 0)
        if moved.any():
            raise InvalidArgumentError(
                f"sequence {seq} layer {layer}: block {int(fresh[moved.argmax()])} is no longer "
                "at level 0 on the device, so tokens cannot be written into it"
            )

    def _write(
        self, seq: int, layer: int, start: int, end: int, k: Any, v: Any, norms: np.ndarray
    ) -> None:
        torch = torch_module()
        bs = self.block_size
        positions = np.arange(start, end)
        index = positions // bs
        blocks = self.core.sequence_blocks(seq)[index[0] : index[-1] + 1]
        offset = positions % bs
        tok_blocks = blocks[index - index[0]]
        # Tokens already there (a shared block its owner wrote) are not written again.
        fresh = offset >= self._written[tok_blocks, layer]
        if not fresh.any():
            return
        info = self.core.block_info(blocks)
        where = np.nonzero(fresh)[0]
        local = index[where] - index[0]
        slots = torch.from_numpy(info["slot"][local].astype(np.int64)).to(self.device)
        offs = torch.from_numpy(offset[where]).to(self.device)
        sel = torch.from_numpy(where).to(self.device)
        pool = self.pools["device", 0]
        ks, vs = (k, v) if len(where) == len(positions) else (k[sel], v[sel])
        pool[slots, layer, 0, :, offs] = ks
        pool[slots, layer, 1, :, offs] = vs
        # Bookkeeping after the writes: a block's written count is its highest written offset.
        touched = tok_blocks[where]
        np.maximum.at(self._written[:, layer], touched, offset[where] + 1)
        np.add.at(self._norm_sum, touched, norms[where])
        np.add.at(self._norm_count, touched, 1)
        uniq = np.unique(touched)
        self.core.set_magnitude(
            uniq, (self._norm_sum[uniq] / self._norm_count[uniq]).astype(np.float32)
        )
        self._finish(uniq[self._pinned[uniq] & (self._written[uniq] == bs).all(axis=1)])

    def _finish(self, done: np.ndarray) -> None:
        """Blocks every layer has written in full: unpinned (and queued to be published)."""
        if not len(done):
            return
        self.core.unpin(done)
        self._pinned[done] = False
        if self._shared is not None:
            hashes = self.core.block_info(done)["hash"]
            # Pinned again (the core counts pins) until the next step has published it: no
            # plan moves it nor eviction frees it before its bytes are sent.
            hashed = hashes != 0
            self.core.pin(done[hashed])
            self._unpublished.update(
                zip(done[hashed].tolist(), hashes[hashed].tolist(), strict=True)
            )

    def _locations(
        self, blocks: np.ndarray
    ) -> Iterator[tuple[tuple[str, int], torch.Tensor, np.ndarray, np.ndarray]]:
        """Blocks grouped by pool: ``((tier, level), rows in blocks, slots, block ids)``."""
        torch = torch_module()
        if not len(blocks):
            return
        info = self.core.block_info(blocks)
        key = info["tier"].astype(np.int64) * 256 + info["level"]
        for k in np.unique(key):
            rows = np.nonzero(key == k)[0]
            tier = Plan.TIERS[int(k) // 256]
            yield (
                (tier, int(k) % 256),
                torch.from_numpy(rows).to(self.device),
                info["slot"][rows],
                blocks[rows],
            )

    def _attended(self, seq: int, tokens: int) -> tuple[np.ndarray, int]:
        """The blocks of the first ``tokens`` tokens of ``seq`` that attention sees, and their
        tokens: all of them, less those a ``drop`` level took out. Dropped blocks are full ones
        (never the sink, the recent window, nor the block being filled), so the tokens left
        fill the blocks left in order."""
        blocks = self.core.sequence_blocks(seq)[: -(-tokens // self.block_size)]
        if self.drop_level is None:
            return blocks, tokens
        kept = blocks[self.core.block_info(blocks)["level"] != self.drop_level]
        return kept, tokens - (len(blocks) - len(kept)) * self.block_size

    def _check_not_lost(self, seq: int, blocks: np.ndarray) -> None:
        lost = blocks[self._lost[blocks]]
        if len(lost):
            raise BlockLostError(
                f"sequence {seq}: block {int(lost[0])} was lost from a store tier (corrupt, "
                "evicted by the server, or the server is gone); free the sequence and compute "
                "its K/V again"
            )

    def _read_layer(
        self, tier: str, level: int, slots: np.ndarray, layer: int, blocks: np.ndarray
    ) -> torch.Tensor:
        """``[n, 2, kv_heads, block_size, head_dim]`` of one layer of blocks, on the device."""
        pool, idx = self._source((tier, level), slots, blocks)
        idx = idx.to(pool.device)
        if level == 0:
            return pool[:, layer].index_select(0, idx).to(self.device, non_blocking=True)
        return self.codecs[level].decode_layer(
            pool, self.shape, layer, slots=idx, dtype=self.dtype, device=self.device
        )


class _StoreRefused(Exception):
    def __init__(self, tier: str) -> None:
        super().__init__(f"the {tier} tier refused a write")
        self.tier = tier


class _Lost(Exception):
    def __init__(self, tier: str, blocks: np.ndarray) -> None:
        super().__init__(f"{len(blocks)} block(s) lost from the {tier} tier")
        self.tier, self.blocks = tier, blocks


_F32_MAX = float(np.finfo(np.float32).max)


def _memory_of(where: str, device: Any) -> int | None:
    """Bytes of memory of the CPU (physical) or of the CUDA device; None where unknown."""
    if where == "cuda":
        torch = torch_module()
        return int(torch.cuda.mem_get_info(device)[1])
    if where != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _key_norms(k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """Per token, the mean over heads of its key's norm (the magnitude signal), once K and V
    are known to be finite: NaN or inf would reach attention as garbage (one NaN key poisons
    the softmax of every query that sees it), so either is refused before anything is stored.
    K's check rides on its norms; only a non-finite norm looks at K itself."""
    norms = k.float().norm(dim=-1).mean(dim=-1).cpu().numpy()
    if not np.isfinite(norms).all():
        if not all_finite(k):
            raise InvalidArgumentError(
                "k: expected finite values, got NaN or inf; nothing was stored"
            )
        norms = np.minimum(np.nan_to_num(norms, posinf=_F32_MAX), _F32_MAX)  # fp32 overflow
    if not all_finite(v):
        raise InvalidArgumentError("v: expected finite values, got NaN or inf; nothing was stored")
    return norms


def _key_norm_sums(rows: torch.Tensor) -> torch.Tensor:
    """Per level-0 row ``[n, layers, 2, kv_heads, block_size, head_dim]``: the sum over its
    layers and tokens of each token's key norm averaged over heads."""
    return rows[:, :, 0].float().norm(dim=-1).mean(dim=2).sum(dim=(1, 2))


def _sequence_ids(seqs: Any) -> tuple[bool, tuple[int, ...]]:
    """``(single, ids)`` of attend's ``seqs``: one sequence id, or a sequence of them."""
    if isinstance(seqs, (int, np.integer)) and not isinstance(seqs, bool):
        return True, (int(seqs),)
    if (
        isinstance(seqs, (str, bytes))
        or not hasattr(seqs, "__iter__")
        or (hasattr(seqs, "dim") and seqs.dim() == 0)
    ):
        raise InvalidArgumentError(
            f"seqs: expected a sequence id or a list of them, got {type(seqs).__name__} {seqs!r}"
        )
    ids = []
    for s in seqs:
        if hasattr(s, "item") and getattr(s, "ndim", 0) == 0:  # a numpy or torch scalar
            s = s.item()
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool):
            raise InvalidArgumentError(
                f"seqs: expected integer sequence ids, got {type(s).__name__} {s!r} in {seqs!r}"
            )
        ids.append(int(s))
    return False, tuple(ids)


def _softmax_scale(scale: Any) -> float:
    number = isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(
        scale, bool
    )
    if number and math.isfinite(scale):
        return float(scale)
    raise InvalidArgumentError(f"scale: expected a finite number or None, got {scale!r}")


def _token_array(token_ids: Any) -> np.ndarray:
    arr = np.asarray(token_ids.cpu() if hasattr(token_ids, "cpu") else token_ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgumentError(
            f"token_ids: expected a 1-D sequence of integer token ids, got {arr.dtype} "
            f"{list(arr.shape)}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint32).max):
        raise InvalidArgumentError("token_ids: expected ids in [0, 2**32)")
    return arr.astype(np.uint32)


def _per_block(per_token: np.ndarray, block_size: int) -> np.ndarray:
    m = math.ceil(len(per_token) / block_size)
    padded = np.zeros(m * block_size, dtype=np.float64)
    padded[: len(per_token)] = per_token
    return padded.reshape(m, block_size).sum(axis=1)
