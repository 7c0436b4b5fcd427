"""The rules of :class:`kvtier._core.Core` in plain Python: :class:`ModelCore`, for one device tier.

Written the way one would without kvtier: dicts, lists and loops, no numpy in its logic (numpy
arrays given to it are turned into Python lists first). It is the oracle of the Hypothesis test
(``tests/test_model_hypothesis.py``: random operation sequences must leave it and the Rust core
in the same observable state) and the plain-Python equivalent ``kvtier bench core`` times the
core against.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidSequenceError,
    OutOfCapacityError,
    PlanError,
)

from .frequency import Frequency
from .xxh3 import chain_hash, chain_seed, namespace_seed

__all__ = ["KINDS", "POLICIES", "ModelCore", "ModelPlan"]


# ---- f32 arithmetic ---------------------------------------------------------------------------
#
# The core keeps statistics as f32. One IEEE operation on two f32 values computed in f64 and then
# rounded to f32 gives the correctly rounded f32 result (f64 has more than 2*24+2 bits), so each
# f32 operation of the core is `_f32(a op b)` here.

_F32 = struct.Struct("<f")


def _f32(x: float) -> float:
    try:
        return float(_F32.unpack(_F32.pack(x))[0])
    except OverflowError:  # beyond the f32 range: the C cast gives infinity
        return math.copysign(math.inf, x)


def _round_half_away(x: float) -> float:
    """Rust's ``f64::round`` for x >= 0 (Python's ``round`` rounds half to even)."""
    r = math.floor(x)
    return float(r + 1) if x - r >= 0.5 else float(r)


# ---- the rules of kvtier._core.Core, single device tier ----------------------------------------

DEMOTE, PROMOTE, OFFLOAD, FETCH, EVICT, DROP, BACKUP = range(7)
KINDS = ("demote", "promote", "offload", "fetch", "evict", "drop", "backup")
POLICIES = ("importance", "lru", "lfu", "h2o", "scissorhands")
_KNOWN_MAGNITUDE, _KNOWN_LEARNED, _KNOWN_ATTENTION = 1, 2, 4
_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
#: Steps covered by the decay table (the core's `stats::DECAY_TABLE_LEN`): beyond it, powi.
DECAY_TABLE_LEN = 1024

#: One move: (block, kind, src_level, dst_level); dst_level is None for an eviction.
Move = tuple[int, int, int, "int | None"]
Key = tuple[float, float, int]
#: ``Core.counters()`` keys kept by the model (plus ``live_blocks`` and ``cached_blocks``).
COUNTERS = (
    "allocated", "released", "shared_hits", "evictions", "demotions", "promotions", "offloads",
    "fetches", "drops", "backups", "noop_promotions", "deferred_moves", "bytes_moved", "plans",
    "aborts", "cancelled_moves",
)  # fmt: skip


@dataclass
class ModelPlan:
    id: int
    moves: list[Move]
    noop_promotions: int
    deferred: int
    unmet_bytes: int
    #: The blocks it evicts that it took out of their prefix tree (prefix-aware), each with its
    #: parent's hash (``None``: a root), in move order: linked back if cancelled or aborted.
    parked: list[tuple[int, int | None]] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.moves:
            out[KINDS[m[1]]] = out.get(KINDS[m[1]], 0) + 1
        return out


@dataclass
class _Seq:
    blocks: list[int]
    tokens: int
    chain: int
    partial: list[int] = field(default_factory=list)
    #: its conversation ended (``release``): the blocks it lets go of last are released
    released: bool = False

    def clone(self) -> _Seq:
        """A fork: it goes on with the conversation, so it is not released."""
        return _Seq(list(self.blocks), self.tokens, self.chain, list(self.partial))


class _Pass:
    __slots__ = ("cap", "deferred", "moved", "moves", "noop", "parked", "projected")

    def __init__(self, projected: int, cap: int) -> None:
        self.moves: list[Move] = []
        self.parked: list[tuple[int, int | None]] = []
        self.projected = projected
        self.moved = 0
        self.cap = cap
        self.noop = 0
        self.deferred = 0


class ModelCore:
    """The rules of :class:`kvtier._core.Core` in plain Python (lists and dicts, no numpy).

    It is both the oracle of the Hypothesis test (random operation sequences must leave it and
    the Rust core in the same observable state) and the "plain-Python equivalent" the benchmark
    times the core against. Covered, exactly as the core does them: one ``device`` tier with an
    optional byte budget; any level ladder (including a ``drop`` level of 0 bytes); sequences
    (``add_sequence``, ``append_blocks``, ``append_tokens`` with chained XXH3 hashes, ``fork``,
    ``free_sequence``, ``release``); the prefix index, ``lookup``/``lookup_tokens``, ``forget``
    and ``release_cached``/``release_cached_tokens``; refcounts,
    cached blocks and eviction on a full device (``evict_on_full``); all statistics
    (``record_reads``, ``record_attention``, ``set_magnitude``, ``set_learned``) with the core's
    f32 rounding; all five policies' ranking keys; ``pin``/``unpin``; ``plan``/``commit``/
    ``abort`` — the live rank split with sinks, recent window, ``compression_ratio`` and
    hysteresis, no-op promotions, the move cap, and budget pressure (demote one level lowest key
    first, a prefix-aware core's cached chain ends after every other cached block: leaves, then
    sinks; drop live blocks above the budget, then evict cached blocks until within it);
    ``set_budget``; the event counters; ``reclaimable``.

    Prefix trees (``prefix_aware``, the default, as in the core): each indexed block links to its
    parent, the block indexed under the hash before its own, and is indexed only while it has
    one (a block at position 0 is a root). Eviction takes leaves only, lowest *eviction key*
    first (the policy's key, except under ``importance``: see :class:`Frequency`); a
    plan's eviction parks the leaf (out of the tree, still indexed) so that its parent may go in
    the same plan, and commit cancels it if the block was pinned, shared again or given a child
    meanwhile (linked back, as an abort does); a write short of level-0 slots evicts the lowest
    level-0 leaf, else the subtree of the lowest-ranked reclaimable level-0 block leaf first;
    forgetting or dropping a block takes its indexed descendants out of the index too. With
    ``prefix_aware=False`` the model is the plain core: any cached block may be evicted.

    Released chains (``release``, ``release_cached``, ``release_cached_tokens``): a block the
    last sequence to hold it was released, or that ``release_cached`` named since, is evicted
    (prefix-aware) before every block that is not, least recent first; a read, or a holder that
    was not released letting go last, clears the mark.

    Left out: more than one tier (offload, fetch, write-through backups and real promotions),
    ``plan(room_bytes)``, ``extend``, ``pool_headroom`` (pass 4), slot numbers (pools are
    counted, not indexed) and block ids/sequence ids past 2**32. Arguments are plain Python
    ints/floats/lists; numpy arrays are accepted and turned into lists first (the conversion is
    part of the call, so time the model with lists).

    The f32 rounding costs the model nothing measurable (plain Python floats instead: within
    the noise of the benchmark), so its timings are those of a plain-Python implementation.
    """

    def __init__(
        self,
        level_bytes: Sequence[int],
        *,
        tiers: Sequence[tuple[str, int | None]] = (("device", None),),
        block_size: int = 16,
        policy: str = "importance",
        enable_compression: bool = True,
        pressure_only: bool = False,
        compression_ratio: float = 0.5,
        drop_ratio: float = 0.0,
        recent_window: int = 128,
        sink_blocks: int = 1,
        keep_leaves: int = 2,
        ends_level: int | None = None,  # where ends settle: settle_cached only, left out here
        settle_cached: bool = False,
        weights: tuple[float, float, float] = (0.4, 0.4, 0.2),
        headroom: float = 0.1,
        hysteresis: float = 0.1,
        max_move_bytes: int | None = None,
        decay: float = 0.9,
        attention_ema: float = 0.5,
        scissorhands_window: int = 8,
        write_through: bool = False,
        evict_on_full: bool = True,
        namespace: str = "default",
        pool_slots: Sequence[tuple[str, int, int]] = (),
        prefix_aware: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(
                f"unknown policy {policy!r}: expected one of importance, lru, lfu, h2o, scissorhands"
            )
        if len(tiers) != 1 or tiers[0][0] != "device":
            raise NotImplementedError("ModelCore models a single device tier")
        lb = [int(b) for b in level_bytes]
        f = _f32
        ratio, headroom, hyst = f(compression_ratio), f(headroom), f(hysteresis)
        drop_ratio = f(drop_ratio)
        decay, ema = f(decay), f(attention_ema)
        ws = [f(w) for w in weights]

        def bad(field: str, reason: str) -> ConfigError:
            return ConfigError(f"invalid config: {field}: {reason}")

        if block_size <= 0:
            raise bad("block_size", "expected a positive number of tokens")
        if not 1 <= len(lb) <= 8:
            raise bad("level_bytes", "expected 1 to 8 levels")
        if lb[0] == 0:
            raise bad("level_bytes", "level 0 cannot be drop (0 bytes)")
        if any(b > a for a, b in itertools.pairwise(lb)):
            raise bad("level_bytes", "expected non-increasing bytes per level")
        if not 0.0 <= ratio <= 1.0:
            raise bad("compression_ratio", f"{compression_ratio} is not in [0, 1]")
        if not 0.0 <= drop_ratio <= 1.0:
            raise bad("drop_ratio", f"{drop_ratio} is not in [0, 1]")
        if drop_ratio > 0.0 and 0 not in lb:
            raise bad(
                "drop_ratio", "needs a drop level (a level of 0 bytes) at the end of the ladder"
            )
        if not 0.0 <= headroom < 1.0:
            raise bad("headroom", f"{headroom} is not in [0, 1)")
        if not 0.0 <= hyst <= 1.0:
            raise bad("hysteresis", f"{hysteresis} is not in [0, 1]")
        if not 0.0 < decay <= 1.0:
            raise bad("decay", f"{decay} is not in (0, 1]")
        if not 0.0 < ema <= 1.0:
            raise bad("attention_ema", f"{attention_ema} is not in (0, 1]")
        if any(not math.isfinite(w) or w < 0.0 for w in ws) or f(f(ws[0] + ws[1]) + ws[2]) <= 0.0:
            raise bad("weights", "expected non-negative weights with a positive sum")
        if not 1 <= scissorhands_window <= 32:
            raise bad("scissorhands_window", "expected 1 to 32 reports")
        if settle_cached:
            raise NotImplementedError(
                "ModelCore leaves out explicitly sized pools (pool_headroom), where cached "
                "blocks settle"
            )
        for tier, level, _ in pool_slots:
            if tier != "device" or not 0 <= level < len(lb):
                raise bad("pool_slots", f"no pool {tier}/level {level} in this config")

        self.level_bytes = lb
        self.budget: int | None = tiers[0][1]
        self.block_size = block_size
        self.policy = policy
        self.enable_compression = enable_compression
        self.pressure_only = pressure_only
        self.compression_ratio = ratio
        self.drop_ratio = drop_ratio
        self.recent_window = recent_window
        self.sink_blocks = sink_blocks
        self.keep_leaves = keep_leaves
        self.weights = ws
        self.headroom = headroom
        self.hysteresis = hyst
        self.max_move_bytes = max_move_bytes
        self.attention_ema = ema
        self.scissorhands_window = scissorhands_window
        self.write_through = write_through  # one tier: there is nowhere to write through to
        self.evict_on_full = evict_on_full
        self.namespace = namespace
        self.prefix_aware = prefix_aware
        self.seed = namespace_seed(namespace)
        self.explicit_levels = {level for _, level, _ in pool_slots}
        self.last_kept = sum(1 for _ in itertools.takewhile(lambda b: b > 0, lb)) - 1
        self.drop_level = lb.index(0) if 0 in lb else None

        # Pools: capacity and slots in use per level (slot numbers are not modelled).
        explicit = {level: slots for _, level, slots in pool_slots}
        cap = []
        for level, b in enumerate(lb):
            if level in explicit:
                cap.append(explicit[level])
            elif b == 0:
                cap.append(0)
            elif self.budget is not None:
                cap.append(min(self.budget // b, _U32_MAX - 1))
            else:
                cap.append(_U32_MAX - 1)
        self.capacity = cap
        self.used = [0] * len(lb)
        self.tier_bytes = 0

        # decay^k as the core computes it: a table of repeated f32 products, else powi.
        table = [1.0]
        for _ in range(DECAY_TABLE_LEN - 1):
            table.append(f(table[-1] * decay))
        self._decay = decay
        self._decay_table = table
        self._log_inv = -math.log(decay)

        # Block columns, indexed by block id (as in the core).
        self.live: list[bool] = []
        self.refcount: list[int] = []
        self.pins: list[int] = []
        self.moving: list[bool] = []
        self.level: list[int] = []
        self.hash: list[int] = []
        self.indexed: list[bool] = []
        self.position: list[int] = []
        self.fill: list[int] = []
        #: the block's conversation ended (see ``release``): evicted first
        self.released: list[bool] = []
        #: how often a sequence took its hash before, capped (``importance``, prefix-aware)
        self.reuse_class: list[int] = []
        # The prefix trees (prefix-aware): each indexed block's parent (-1: a root, or not in a
        # tree) and its indexed children, the one linked last first (the core's `first_child`).
        self.parent: list[int] = []
        self.children: list[list[int]] = []
        self.free_ids: list[int] = []
        # Statistics columns.
        self.reads: list[float] = []
        self.reads_step: list[int] = []
        self.last_access: list[int] = []
        self.attn_ema: list[float] = []
        self.attn_sum: list[float] = []
        self.attn_history: list[int] = []
        self.magnitude: list[float] = []
        self.learned: list[float] = []
        self.known: list[int] = []
        self.importance: list[float] = []

        self.index: dict[int, int] = {}
        self.seqs: dict[int, _Seq] = {}
        self.next_seq = 0
        self.step = 0
        self.clock = 0
        #: Evictable ("cached") blocks: live, refcount 0, unpinned, not moving, holding a slot.
        self.cached: set[int] = set()
        self.pending: ModelPlan | None = None
        self.next_plan = 1
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._key = self._key_function()
        #: eviction adapts to measured reuse (see :class:`Frequency`)
        self.adaptive = self.prefix_aware and self.policy == "importance"
        self.frequency = Frequency()

    # ---- ranking keys --------------------------------------------------------------------------

    def _freq(self, b: int) -> float:
        r = self.reads[b]
        return math.log(r) + self.reads_step[b] * self._log_inv if r > 0.0 else -math.inf

    def _key_function(self) -> Callable[[int], Key]:
        la = self.last_access
        if self.policy == "lru":
            return lambda b: (0.0, 0.0, la[b])
        if self.policy == "lfu":
            return lambda b: (self._freq(b), 0.0, la[b])
        if self.policy == "h2o":
            return lambda b: (self.attn_sum[b], 0.0, la[b])
        if self.policy == "scissorhands":
            mask = _U32_MAX >> (32 - self.scissorhands_window)
            return lambda b: (
                float((self.attn_history[b] & mask).bit_count()),
                self.attn_ema[b],
                la[b],
            )
        return lambda b: (self.importance[b], self._freq(b), la[b])

    def key(self, b: int) -> Key:
        """The policy's ranking key of block ``b``: lower is demoted (and, on a plain core,
        evicted) first."""
        return self._key(b)

    def evict_key(self, b: int) -> Key:
        """The key a prefix-aware core queues cached leaves under, lowest first: :meth:`key`,
        but under ``importance`` the block's reuse class, then its last access (eviction ranks
        by :meth:`Frequency.rank` then). A released block goes before every other: no other
        key has -inf in both of its first places (only ``lfu``'s unread blocks have it in the
        first)."""
        if self.released[b]:
            return (-math.inf, -math.inf, self.last_access[b])
        if self.policy == "importance":
            return (float(self.reuse_class[b]), 0.0, self.last_access[b])
        return self._key(b)

    def score(self, b: int) -> float:
        """``Core.block_info(...)["score"]``: the key's primary component."""
        return float(self._key(b)[0])

    def _decay_pow(self, k: int) -> float:
        if k < DECAY_TABLE_LEN:
            return self._decay_table[k]
        # f32::powi: square-and-multiply in f32 (compiler-rt's __powisf2).
        a, r = self._decay, 1.0
        while True:
            if k & 1:
                r = _f32(r * a)
            k >>= 1
            if k == 0:
                return r
            a = _f32(a * a)

    # ---- pools, ids, the eviction set ----------------------------------------------------------

    def _take_slot(self, level: int) -> bool:
        if self.used[level] >= self.capacity[level]:
            return False
        self.used[level] += 1
        self.tier_bytes += self.level_bytes[level]
        return True

    def _give_slot(self, level: int) -> None:
        if self.level_bytes[level] == 0:  # a dropped block holds no slot
            return
        self.used[level] -= 1
        self.tier_bytes -= self.level_bytes[level]

    def _refresh(self, b: int) -> None:
        if (
            self.live[b]
            and self.refcount[b] == 0
            and self.pins[b] == 0
            and not self.moving[b]
            and self.level_bytes[self.level[b]] > 0
        ):
            self.cached.add(b)
        else:
            self.cached.discard(b)

    def _check_blocks(self, ids: Sequence[int]) -> None:
        live, n = self.live, len(self.live)
        for b in ids:
            if not (0 <= b < n and live[b]):
                raise InvalidBlockError(
                    f"unknown block {b}: not allocated (freed, evicted, or never handed out)"
                )

    def _new_block(self, position: int) -> int:
        """A new block at level 0 on the device; the caller made room for it."""
        took = self._take_slot(0)
        assert took, "room ensured before allocating"
        if self.free_ids:
            b = self.free_ids.pop()
        else:
            b = len(self.live)
            columns: tuple[list[Any], ...] = (
                self.live, self.refcount, self.pins, self.moving, self.level, self.hash,
                self.indexed, self.position, self.fill, self.released, self.reuse_class,
                self.reads, self.reads_step,
                self.last_access, self.attn_ema, self.attn_sum, self.attn_history,
                self.magnitude, self.learned, self.known, self.importance,
            )  # fmt: skip
            for col in columns:
                col.append(0)  # every column is set below
            self.parent.append(-1)
            self.children.append([])
        # A released block left its tree (eviction takes leaves): no parent, no children.
        assert self.parent[b] == -1 and not self.children[b]
        self.live[b] = True
        self.refcount[b] = 1
        self.pins[b] = 0
        self.moving[b] = False
        self.level[b] = 0
        self.hash[b] = 0
        self.indexed[b] = False
        self.fill[b] = 0
        self.released[b] = False
        self.reuse_class[b] = 0
        self.position[b] = position
        self.reads[b] = 0.0
        self.reads_step[b] = self.step
        self.attn_ema[b] = self.attn_sum[b] = 0.0
        self.attn_history[b] = 0
        self.magnitude[b] = self.learned[b] = self.importance[b] = 0.0
        self.known[b] = 0
        self.counters["allocated"] += 1
        self.clock += 1
        self.last_access[b] = self.clock
        return b

    def _release(self, b: int) -> None:
        """Frees a block nobody needs: its place in the index (and tree), its slot, its id."""
        self._leave_prefix_index(b)
        self.live[b] = False
        self.cached.discard(b)
        self._give_slot(self.level[b])
        self.free_ids.append(b)
        self.counters["released"] += 1

    def _release_if_orphan(self, b: int) -> None:
        if (
            self.live[b]
            and self.refcount[b] == 0
            and self.pins[b] == 0
            and not self.moving[b]
            and not self.indexed[b]
        ):
            self._release(b)

    def _end(self, b: int) -> int:
        """Which end of its chain a cached block of a prefix-aware core is, in the order
        demotion takes them, after every other cached block: 0 none, 1 one of the chain's last
        ``keep_leaves`` blocks (a leaf, or a block that many links above one), 2 a sink (one of
        the first ``sink_blocks``)."""
        if not self.prefix_aware:
            return 0
        if self.position[b] < self.sink_blocks:
            return 2
        return int(
            self.keep_leaves > 0 and self.indexed[b] and self._near_leaf(b, self.keep_leaves - 1)
        )

    def _near_leaf(self, b: int, below: int) -> bool:
        """Whether a leaf of the prefix tree is ``b`` or lies at most ``below`` links under it."""
        children = self.children[b]
        return not children or (below > 0 and any(self._near_leaf(c, below - 1) for c in children))

    def _lowest(self, levels: Iterable[int], key: Callable[[int], Key]) -> int | None:
        """The cached block of ``levels`` lowest by ``key``, if any."""
        allowed = set(levels)
        best: tuple[Key, int] | None = None
        for b in self.cached:
            if self.level[b] in allowed:
                c = (key(b), b)
                if best is None or c < best:
                    best = c
        return None if best is None else best[1]

    def _lowest_evictable(self, levels: Iterable[int]) -> int | None:
        """What eviction takes first among ``levels``: the cached leaf lowest by eviction key
        (prefix-aware), else the cached block lowest by key. Under ``importance`` (adaptive),
        the key is :meth:`Frequency.rank`'s, and in each level where the lowest leaf is a
        first-seen block too young to be reused before it goes, the youngest first-seen leaf
        of that level goes instead (under the same key, against the other levels)."""
        if not self.prefix_aware:
            return self._lowest(levels, self._key)
        if not self.adaptive:
            allowed = set(levels)
            best: tuple[Key, int] | None = None
            for b in self.cached:
                if self.level[b] in allowed and not self.children[b]:
                    c = (self.evict_key(b), b)
                    if best is None or c < best:
                        best = c
            return None if best is None else best[1]
        freq, now = self.frequency, self.clock
        la, cls, rel = self.last_access, self.reuse_class, self.released
        candidates = []
        for level in dict.fromkeys(levels):
            leaves = [b for b in self.cached if self.level[b] == level and not self.children[b]]
            if not leaves:
                continue
            # Each class's least recently used leaf is its candidate (the core's leaf queues).
            # Released leaves share a queue, ahead of the first-seen ones.
            oldest: dict[int, tuple[int, int]] = {}
            for b in leaves:
                queue = -1 if rel[b] else cls[b]
                if queue not in oldest or (la[b], b) < oldest[queue]:
                    oldest[queue] = (la[b], b)
            key, b = min((freq.rank(cls[b], la[b], rel[b], now), b) for _, b in oldest.values())
            if freq.young_first(cls[b], la[b], rel[b], now):  # (b itself is first-seen)
                b = max((la[y], y) for y in leaves if cls[y] == 0 and not rel[y])[1]
            candidates.append((key, b))
        return min(candidates)[1] if candidates else None

    def _evict_now(self, b: int) -> None:
        self.counters["evictions"] += 1
        self.frequency.evicted(max(self.clock - self.last_access[b], 0))
        self._release(b)

    # ---- the prefix trees ------------------------------------------------------------------------

    def _parent_for(self, position: int, prev: int) -> int | None:
        """The parent a block at ``position`` whose hash chains on from ``prev`` takes: -1 for a
        root (position 0, or a plain core), else the block indexed under ``prev``; ``None`` if
        none is (the block must not be indexed: it could never load)."""
        if not self.prefix_aware or position == 0:
            return -1
        return self.index.get(prev)

    def _attach(self, b: int, parent: int) -> None:
        self.parent[b] = parent
        if parent != -1:
            self.children[parent].insert(0, b)

    def _detach(self, b: int) -> int:
        """Unlinks ``b``, a leaf, from its parent; returns the parent (-1: none)."""
        assert not self.children[b], "detaching a block with children"
        parent = self.parent[b]
        if parent != -1:
            self.children[parent].remove(b)
        self.parent[b] = -1
        return parent

    def _index_block(self, b: int, h: int, parent: int | None) -> None:
        """Indexes ``b`` under ``h`` below ``parent`` (from :meth:`_parent_for`), unless the
        parent is missing or another block holds ``h`` (``b`` then stays private)."""
        if parent is None or h in self.index:
            return
        self.index[h] = b
        self.indexed[b] = True
        if self.prefix_aware:
            self._attach(b, parent)

    def _unindex_leaf(self, b: int) -> None:
        self.indexed[b] = False
        if self.index.get(self.hash[b]) == b:
            del self.index[self.hash[b]]
        if self.prefix_aware:
            self._detach(b)

    def _leave_prefix_index(self, b: int) -> None:
        """Takes ``b`` out of the index with every indexed descendant first, in the core's
        order; a descendant nothing else holds is released."""
        if not self.indexed[b]:
            return
        # The core's walk: a stack of sibling lists, each child listed, then its children.
        order: list[int] = []
        stack = [list(self.children[b])]
        while stack:
            for c in stack.pop():
                order.append(c)
                stack.append(list(self.children[c]))
        for c in reversed(order):  # each after its own descendants
            self._unindex_leaf(c)
            self._refresh(c)
            self._release_if_orphan(c)
        self._unindex_leaf(b)

    def _park(self, b: int) -> int | None:
        """Takes a leaf a plan evicts out of its tree (it stays indexed until the commit), so
        that its parent may become a leaf; returns the parent's hash (``None``: a root)."""
        parent = self._detach(b)
        return None if parent == -1 else self.hash[parent]

    def _unpark(self, b: int, parent_hash: int | None) -> None:
        """Links a parked block back (its eviction was cancelled) under the block indexed under
        ``parent_hash`` now; if none is, the block leaves the index (it could never load)."""
        if not self.live[b] or not self.indexed[b] or self.parent[b] != -1:
            return
        parent = -1
        if parent_hash is not None:
            found = self.index.get(parent_hash)
            if found is None:
                self._leave_prefix_index(b)
                return
            parent = found
        self._attach(b, parent)

    def _reclaimable(self) -> set[int]:
        """The cached blocks evicting leaf after leaf can free: every block of their subtree
        is cached (a plain core: every cached block)."""
        blocked: set[int] = set()
        for b in self.live_blocks():
            if b not in self.cached:
                p = self.parent[b]
                while p != -1 and p not in blocked:
                    blocked.add(p)
                    p = self.parent[p]
        return self.cached - blocked

    def reclaimable(self) -> list[tuple[str, int, int, int]]:
        """``Core.reclaimable()``: (tier, level, blocks, bytes) of each pool's reclaimable
        blocks."""
        count = [0] * len(self.level_bytes)
        for b in self._reclaimable():
            count[self.level[b]] += 1
        return [("device", lv, n, n * self.level_bytes[lv]) for lv, n in enumerate(count)]

    def forget(self, ids: Iterable[int]) -> None:
        """Takes blocks out of the prefix index (prefix-aware: with their indexed descendants);
        each is freed once nothing holds it."""
        ids = _as_list(ids)
        self._check_blocks(ids)
        for b in ids:
            if self.indexed[b]:
                self._leave_prefix_index(b)
                self._refresh(b)
                self._release_if_orphan(b)

    # ---- sequences -------------------------------------------------------------------------------

    def _seq(self, seq: int) -> _Seq:
        s = self.seqs.get(seq)
        if s is None:
            raise InvalidSequenceError(f"unknown sequence {seq}: not created or already freed")
        return s

    def add_sequence(self, salt: str | None = None) -> int:
        seed = chain_seed(self.seed, salt)
        sid = self.next_seq
        self.next_seq = (self.next_seq + 1) & _U32_MAX
        self.seqs[sid] = _Seq([], 0, seed)
        return sid

    def sequences(self) -> list[int]:
        return sorted(self.seqs)

    def sequence_blocks(self, seq: int) -> list[int]:
        return list(self._seq(seq).blocks)

    def sequence_tokens(self, seq: int) -> int:
        return self._seq(seq).tokens

    def _ensure_device_room(self, n: int) -> None:
        if n == 0:
            return
        b0 = self.level_bytes[0]
        need = n * b0
        budget = _U64_MAX if self.budget is None else self.budget

        def fits() -> bool:
            return self.tier_bytes + need <= budget and n <= self.capacity[0] - self.used[0]

        if fits():
            return
        # Decided before evicting anything: a failed append evicts nothing. Evicting the
        # reclaimable blocks frees their bytes, the level-0 ones their slots too.
        reclaimable = self._reclaimable()
        reclaimable_bytes = sum(self.level_bytes[self.level[b]] for b in reclaimable)
        reclaimable0 = sum(1 for b in reclaimable if self.level[b] == 0)
        free_slots = self.capacity[0] - self.used[0]
        bytes_ok = self.tier_bytes + need <= budget + reclaimable_bytes
        slots_ok = n <= free_slots + reclaimable0
        if not self.evict_on_full or not bytes_ok or not slots_ok:
            free = max(0, budget - self.tier_bytes)
            bytes_short = not bytes_ok if self.evict_on_full else free < need
            if bytes_short:
                raise OutOfCapacityError(
                    f"out of capacity in device/level 0: requested {need} bytes, {free} free of a "
                    f"{budget}-byte budget"
                )
            raise OutOfCapacityError(
                f"out of slots in device/level 0: requested {n}, free {free_slots}"
            )
        if self.prefix_aware:
            # Leaves only: level-0 slots first (each such eviction frees bytes too), then bytes.
            while n > self.capacity[0] - self.used[0]:
                self._evict_level0_slot()
            while not fits():
                leaf = self._lowest_evictable(range(len(self.level_bytes)))
                assert leaf is not None, "room was checked before evicting"
                self._evict_now(leaf)
            return
        # A plain core: candidates, lowest key first per level; evicting only removes from them.
        per_level: dict[int, list[tuple[Key, int]]] = {}
        for b in self.cached:
            per_level.setdefault(self.level[b], []).append((self._key(b), b))
        for cands in per_level.values():
            cands.sort(reverse=True)  # pop() takes the lowest
        while not fits():
            levels = [0] if self.tier_bytes + need <= budget else list(per_level)
            heads = [per_level[lv][-1] for lv in levels if per_level.get(lv)]
            _, b = min(heads)
            per_level[self.level[b]].pop()
            self._evict_now(b)

    def evict_cached(self, n: int, protected: Iterable[int] | None = None) -> list[int] | None:
        """``Core.evict_cached``: ``n`` blocks evicted as making room for new level-0 blocks
        does, none of ``protected`` (pinned meanwhile); their hashes, or None, with nothing
        evicted, when fewer than ``n`` could go."""
        ids = _as_list(protected or [])
        self.pin(ids)
        try:
            if sum(1 for b in self._reclaimable() if self.level[b] == 0) < n:
                return None
            return [self._evict_level0_slot() for _ in range(n)]
        finally:
            self.unpin(ids)

    def _evict_level0_slot(self) -> int:
        """Evicts one block towards a free level-0 slot: the lowest level-0 leaf by eviction
        key, else the first leaf down (first children) from the lowest-ranked reclaimable
        level-0 block, chains' ends after the others (its subtree sits at lower levels; there is one:
        room was checked). Returns its hash."""
        leaf = self._lowest_evictable([0])
        if leaf is None:
            reclaimable = self._reclaimable()
            top = min((self._end(b), self._key(b), b) for b in reclaimable if self.level[b] == 0)[2]
            leaf = top
            while self.children[leaf]:
                leaf = self.children[leaf][0]
        hash_ = self.hash[leaf]
        self._evict_now(leaf)
        return hash_

    def _see(self, blocks: list[int]) -> None:
        """Counts a sighting of each hashed block a sequence just took, new or shared, at the
        access clock after the append (adaptive cores only): its reuse class."""
        if self.adaptive:
            for b in blocks:
                if self.hash[b]:
                    self.reuse_class[b] = self.frequency.seen(self.hash[b], self.clock)

    def _share(self, b: int) -> None:
        self.refcount[b] += 1
        self.counters["shared_hits"] += 1
        self._refresh(b)

    def _unshare(self, b: int) -> None:
        self.refcount[b] -= 1
        self.counters["shared_hits"] -= 1
        self._refresh(b)

    def append_blocks(self, seq: int, hashes: Iterable[int]) -> tuple[list[int], list[bool]]:
        """Appends whole blocks by their (already chained) hashes; returns (blocks, shared)."""
        hs = _as_list(hashes)
        bs = self.block_size
        s = self._seq(seq)
        if s.tokens % bs:
            raise InvalidArgumentError(
                f"invalid append_blocks: sequence {seq} ends in a partial block; append tokens instead"
            )
        start = len(s.blocks)
        present = [self.index.get(h) for h in hs]
        for p in present:
            if p is not None:
                self._share(p)
        missing = sum(1 for p in present if p is None)
        try:
            self._ensure_device_room(missing)
        except OutOfCapacityError:
            for p in present:
                if p is not None:
                    self._unshare(p)
            raise
        blocks, shared = [], []
        for k, (h, p) in enumerate(zip(hs, present, strict=True)):
            if p is None:
                b = self._new_block(start + k)
                self.hash[b] = h
                self.fill[b] = bs
                # Indexed unless another block holds the hash (then it stays private).
                if h not in self.index:
                    self.index[h] = b
                    self.indexed[b] = True
            else:
                b = p
            blocks.append(b)
            shared.append(p is not None)
        if self.prefix_aware and missing:
            self._link_new_blocks(start, s.chain, hs, blocks, shared)
        s.blocks.extend(blocks)
        s.tokens += bs * len(hs)
        if hs:
            s.chain = hs[-1]
        self._see(blocks)
        return blocks, shared

    def _link_new_blocks(
        self, start: int, prev: int, hs: list[int], blocks: list[int], shared: list[bool]
    ) -> None:
        """Puts the blocks an append indexed into the prefix trees, in order, each under the
        block indexed under the hash before it (``prev`` before the first); one whose parent
        is missing leaves the index again.

        A parent must already be in the tree: not a block of this append linked after it. The
        core looks the parent up once every new block is indexed, so a chain that repeats the
        hash the sequence ended on, while no block is indexed under it, makes the first new
        block a child of itself or of a later one (a cycle: never a leaf, never evicted). The
        model applies the rule instead (``test_a_block_is_never_its_own_parent`` pins the core's
        deviation).
        """
        unlinked = {b for b, sh in zip(blocks, shared, strict=True) if not sh and self.indexed[b]}
        for k, b in enumerate(blocks):
            if b not in unlinked:
                continue
            unlinked.discard(b)
            parent = self._parent_for(start + k, prev if k == 0 else hs[k - 1])
            if parent is None or parent == b or parent in unlinked:
                self.indexed[b] = False
                del self.index[hs[k]]
            else:
                self._attach(b, parent)

    def append_tokens(self, seq: int, tokens: Iterable[int]) -> tuple[list[int], list[bool]]:
        """Appends token ids; whole blocks whose chained hash is indexed are shared."""
        toks = _as_list(tokens)
        bs = self.block_size
        s = self._seq(seq)
        fill = s.tokens % bs
        head = min(bs - fill, len(toks)) if fill else 0
        rest = toks[head:]
        chain = s.chain
        if fill and fill + head == bs:
            chain = chain_hash(chain, s.partial + toks[:head])
        # Per block: its hash and the hash before it (a full block), the block it shares, length.
        planned: list[tuple[int | None, int, int | None, int]] = []
        for i in range(0, len(rest), bs):
            chunk = rest[i : i + bs]
            if len(chunk) == bs:
                prev, chain = chain, chain_hash(chain, chunk)
                planned.append((chain, prev, self.index.get(chain), bs))
            else:
                planned.append((None, chain, None, len(chunk)))
        for _, _, p, _ in planned:
            if p is not None:
                self._share(p)
        try:
            self._ensure_device_room(sum(1 for _, _, p, _ in planned if p is None))
        except OutOfCapacityError:
            for _, _, p, _ in planned:
                if p is not None:
                    self._unshare(p)
            raise
        if head:
            last = s.blocks[-1]
            s.partial.extend(toks[:head])
            self.fill[last] += head
            if len(s.partial) == bs:
                prev, h = s.chain, chain_hash(s.chain, s.partial)
                s.chain = h
                s.partial = []
                self.hash[last] = h
                # An identical block may already be indexed; this one then stays private.
                self._index_block(last, h, self._parent_for(self.position[last], prev))
        blocks, shared = [], []
        offset = 0
        for bh, prev, p, n in planned:
            if p is None:
                b = self._new_block(len(s.blocks))
                self.fill[b] = n
                if bh is not None:
                    self.hash[b] = bh
                    self._index_block(b, bh, self._parent_for(len(s.blocks), prev))
            else:
                b = p
            if bh is not None:
                s.chain = bh
            else:
                s.partial = rest[offset : offset + n]
            offset += n
            s.blocks.append(b)
            blocks.append(b)
            shared.append(p is not None)
        s.tokens += len(toks)
        self._see(blocks)
        return blocks, shared

    def fork(self, parent: int) -> tuple[int, tuple[int, int] | None]:
        """A child sharing the parent's full blocks; returns (child, (src, dst) of the copy)."""
        s = self._seq(parent)
        partial = s.blocks[-1] if s.tokens % self.block_size else None
        if partial is not None:
            self._ensure_device_room(1)
        for b in s.blocks[:-1] if partial is not None else s.blocks:
            self.refcount[b] += 1
            self._refresh(b)
        child = s.clone()
        copy = None
        if partial is not None:
            dst = self._new_block(self.position[partial])
            self.fill[dst] = self.fill[partial]
            child.blocks[-1] = dst
            copy = (partial, dst)
        cid = self.next_seq
        self.next_seq = (self.next_seq + 1) & _U32_MAX
        self.seqs[cid] = child
        return cid, copy

    def free_sequence(self, seq: int) -> None:
        s = self.seqs.pop(seq, None)
        if s is None:
            raise InvalidSequenceError(f"unknown sequence {seq}: not created or already freed")
        if self.policy == "importance":  # cached blocks keep their last normalised importance
            self._normalise_importance(s.blocks)
        for b in s.blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:  # the last holder decides
                self.released[b] = s.released
            self._refresh(b)
            self._release_if_orphan(b)

    def release(self, seq: int) -> None:
        """The conversation of ``seq`` ended: the blocks it is the last to let go of, when
        freed, are released."""
        self._seq(seq).released = True

    def release_cached(self, hashes: Iterable[int]) -> int:
        """Releases the blocks of the longest indexed prefix of ``hashes``; returns how many."""
        return self._release_blocks(self.lookup(hashes))

    def release_cached_tokens(self, tokens: Iterable[int], salt: str | None = None) -> int:
        """:meth:`release_cached` of the longest indexed prefix of ``tokens``."""
        return self._release_blocks(self.lookup_tokens(tokens, salt))

    def _release_blocks(self, blocks: list[int]) -> int:
        for b in blocks:
            self.released[b] = True
        return len(blocks)

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        out = []
        for h in _as_list(hashes):
            b = self.index.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def lookup_tokens(self, tokens: Iterable[int], salt: str | None = None) -> list[int]:
        toks = _as_list(tokens)
        out, parent, bs = [], chain_seed(self.seed, salt), self.block_size
        for i in range(0, len(toks) - bs + 1, bs):
            parent = chain_hash(parent, toks[i : i + bs])
            b = self.index.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    # ---- statistics --------------------------------------------------------------------------

    def record_reads(self, ids: Iterable[int]) -> None:
        """Counts a read of each listed block: a decayed counter and the access clock."""
        ids = _as_list(ids)
        self._check_blocks(ids)
        step, reads, rstep, la = self.step, self.reads, self.reads_step, self.last_access
        table, pack, unpack = self._decay_table, _F32.pack, _F32.unpack
        cached, refresh, released = self.cached, self._refresh, self.released
        clock = self.clock
        for b in ids:
            age = step - rstep[b]
            d = table[age] if age < DECAY_TABLE_LEN else self._decay_pow(age)
            r = unpack(pack(reads[b] * d))[0]
            reads[b] = unpack(pack(r + 1.0))[0]
            rstep[b] = step
            clock += 1
            la[b] = clock
            released[b] = False  # read again: the conversation goes on
            if b in cached:
                refresh(b)
        self.clock = clock

    def _check_values(self, what: str, ids: list[int], values: list[float]) -> None:
        if len(ids) != len(values):
            raise InvalidArgumentError(f"{what}: expected {len(ids)} values, got {len(values)}")
        for v in values:
            if not math.isfinite(v) or v < 0.0:
                raise InvalidArgumentError(
                    f"invalid {what}: {v} is not a finite non-negative number"
                )
        self._check_blocks(ids)

    def record_attention(self, ids: Iterable[int], mass: Iterable[float]) -> None:
        ids, ms = _as_list(ids), [_f32(m) for m in _as_list(mass)]
        self._check_values("attention mass", ids, ms)
        total = 0.0
        for m in ms:
            total += m
        mean = total / max(len(ms), 1)
        alpha = self.attention_ema
        keep = _f32(1.0 - alpha)
        for b, m in zip(ids, ms, strict=True):
            if self.known[b] & _KNOWN_ATTENTION:
                self.attn_ema[b] = _f32(_f32(alpha * m) + _f32(keep * self.attn_ema[b]))
            else:
                self.attn_ema[b] = m
            self.attn_sum[b] = _f32(self.attn_sum[b] + m)
            self.attn_history[b] = ((self.attn_history[b] << 1) | (m >= mean)) & _U32_MAX
            self.known[b] |= _KNOWN_ATTENTION
            if b in self.cached:
                self._refresh(b)

    def set_magnitude(self, ids: Iterable[int], values: Iterable[float]) -> None:
        ids, vs = _as_list(ids), [_f32(v) for v in _as_list(values)]
        self._check_values("magnitude", ids, vs)
        for b, v in zip(ids, vs, strict=True):
            self.magnitude[b] = v
            self.known[b] |= _KNOWN_MAGNITUDE

    def set_learned(self, ids: Iterable[int], values: Iterable[float]) -> None:
        ids, vs = _as_list(ids), [_f32(v) for v in _as_list(values)]
        self._check_values("learned score", ids, vs)
        for b, v in zip(ids, vs, strict=True):
            self.learned[b] = v
            self.known[b] |= _KNOWN_LEARNED

    # ---- pins ----------------------------------------------------------------------------------

    def pin(self, ids: Iterable[int]) -> None:
        ids = _as_list(ids)
        self._check_blocks(ids)
        for b in ids:
            self.pins[b] += 1
            self._refresh(b)

    def unpin(self, ids: Iterable[int]) -> None:
        ids = _as_list(ids)
        self._check_blocks(ids)
        count: dict[int, int] = {}
        for b in ids:
            count[b] = count.get(b, 0) + 1
        for b in sorted(count):
            if self.pins[b] < count[b]:
                raise InvalidArgumentError(f"invalid unpin: block {b} is not pinned")
        for b in ids:
            self.pins[b] -= 1
            self._refresh(b)
            self._release_if_orphan(b)

    # ---- inspection ----------------------------------------------------------------------------

    def live_blocks(self) -> list[int]:
        return [b for b, alive in enumerate(self.live) if alive]

    def block_parent(self, b: int) -> int:
        """``block_info``'s ``parent``: the block's parent in its prefix tree, -1 for a root, an
        unindexed block (or one a pending plan evicts) and on a plain core."""
        return self.parent[b] if self.indexed[b] else -1

    def block_hash(self, b: int) -> int:
        """The block's chained hash, 0 for a partial block (as ``block_info``)."""
        return self.hash[b] if self.fill[b] == self.block_size else 0

    def usage(self) -> list[tuple[str, int, int, int, int]]:
        return [
            ("device", level, self.used[level], self.capacity[level], self.used[level] * b)
            for level, b in enumerate(self.level_bytes)
        ]

    def counters_dict(self) -> dict[str, int]:
        """``Core.counters()``."""
        return {
            **self.counters,
            "live_blocks": len(self.live) - len(self.free_ids),
            "cached_blocks": len(self.cached),
        }

    def set_budget(self, tier: str, budget: int | None) -> None:
        if tier != "device":
            raise InvalidArgumentError(f"invalid tier: {tier} is not configured")
        self.budget = budget
        # Pools sized from the budget grow with it; they never shrink.
        for level, b in enumerate(self.level_bytes):
            if level not in self.explicit_levels and b > 0:
                slots = _U32_MAX - 1 if budget is None else min(budget // b, _U32_MAX - 1)
                self.capacity[level] = max(self.capacity[level], slots)

    # ---- the scheduler -------------------------------------------------------------------------

    def plan(self) -> ModelPlan:
        """Plans moves and holds them pending until :meth:`commit` or :meth:`abort`."""
        if self.pending is not None:
            raise PlanError(
                f"plan {self.pending.id} is still pending: commit or abort it before planning again"
            )
        self.step = (self.step + 1) & _U32_MAX
        self.counters["plans"] += 1
        cap = _U64_MAX if self.max_move_bytes is None else self.max_move_bytes
        p = _Pass(self.tier_bytes, cap)
        wishes = self._level_wishes()
        self._move_live_blocks(p, wishes)
        unmet = self._relieve_pressure(p, wishes)
        plan = ModelPlan(self.next_plan, p.moves, p.noop, p.deferred, unmet, p.parked)
        self.next_plan += 1
        self.counters["noop_promotions"] += p.noop
        self.counters["deferred_moves"] += p.deferred
        self.pending = plan
        return plan

    def _level_wishes(self) -> list[tuple[int, int, bool]]:
        """(block, wished level, protected) per referenced block, by block id."""
        bs, window, sinks = self.block_size, self.recent_window, self.sink_blocks
        may_drop = self.drop_level is not None
        drops = may_drop and self.drop_ratio > 0.0
        compress = (
            self.enable_compression and not self.pressure_only and (self.last_kept > 0 or drops)
        )
        low = min(self.last_kept, 2)
        ratio, hyst = self.compression_ratio, self.hysteresis
        lb, level, key = self.level_bytes, self.level, self._key
        wish: dict[int, int] = {}
        protected: set[int] = set()

        def want(b: int, lv: int) -> None:
            w = wish.get(b)
            if w is None or lv < w:
                wish[b] = lv

        for sid in sorted(self.seqs):
            s = self.seqs[sid]
            blocks = s.blocks
            recent_from = max(0, s.tokens - window) // bs
            if may_drop:  # the newest block stays, however small the window
                recent_from = min(recent_from, max(len(blocks) - 1, 0))
            if self.policy == "importance":
                self._normalise_importance(blocks)
            ranked: list[tuple[Key, int]] = []
            dropped = 0
            for i, b in enumerate(blocks):
                if i < sinks or i >= recent_from:
                    want(b, 0)
                    protected.add(b)
                elif lb[level[b]] > 0:
                    ranked.append((key(b), b))
                else:
                    dropped += 1
            if not compress:
                for _, b in ranked:
                    want(b, 0)
                continue
            if self.drop_level is not None and self.drop_ratio > 0.0:
                # The lowest ranked leave attention until drop_ratio of the ranked blocks (the
                # dropped ones counted: they never come back) are out.
                out = int(_round_half_away(self.drop_ratio * float(len(ranked) + dropped)))
                more = min(max(0, out - dropped), len(ranked))
                if more:
                    ranked.sort()
                    for _, b in ranked[:more]:
                        want(b, self.drop_level)
                    # A block a sequence holds twice is out with all its places.
                    cut = ranked[more - 1]
                    ranked = [kb for kb in ranked if kb > cut]
            if low == 0:  # only level 0 holds bytes: the blocks kept stay there
                for _, b in ranked:
                    want(b, 0)
                continue
            # The level-1 quota is filled from the blocks still at level 0 or 1 (a lossy
            # level cannot give precision back); level 1 is kept within the hysteresis band.
            m = float(len(ranked))
            quota = _round_half_away(ratio * m)
            eligible = sorted((kb for kb in ranked if level[kb[1]] <= 1), reverse=True)
            reach = min(math.ceil(quota), len(eligible))
            keep = min(math.ceil(quota + hyst * m), len(eligible))
            for rank, (_, b) in enumerate(eligible):
                level_1 = rank < (keep if level[b] == 1 else reach)
                want(b, 1 if level_1 or low == 1 else low)
            for _, b in ranked:
                if level[b] > 1:
                    want(b, max(level[b], low))
        return [(b, wish[b], b in protected) for b in sorted(wish)]

    def _normalise_importance(self, blocks: list[int]) -> None:
        f, known, ws = _f32, self.known, self.weights
        signals = (
            (self.magnitude, _KNOWN_MAGNITUDE),
            (self.learned, _KNOWN_LEARNED),
            (self.attn_ema, _KNOWN_ATTENTION),
        )
        ranges = []
        for values, bit in signals:
            lo, hi = math.inf, -math.inf
            for b in blocks:
                if known[b] & bit:
                    v = values[b]
                    lo, hi = min(lo, v), max(hi, v)
            ranges.append((lo, hi))
        out = []
        for b in blocks:
            total = weight = 0.0
            for k, (values, bit) in enumerate(signals):
                if known[b] & bit:
                    lo, hi = ranges[k]
                    x = f(f(values[b] - lo) / f(hi - lo)) if hi > lo else 0.5
                    total = f(total + f(ws[k] * x))
                    weight = f(weight + ws[k])
            out.append(f(total / weight) if weight > 0.0 else 0.0)
        for b, v in zip(blocks, out, strict=True):
            self.importance[b] = v

    def _movable(self, b: int) -> bool:
        return self.pins[b] == 0 and not self.moving[b]

    def _push_move(self, p: _Pass, b: int, kind: int, dst: int | None) -> bool:
        copies = kind not in (EVICT, DROP)
        src = self.level[b]
        src_bytes = self.level_bytes[src]
        if copies and p.moved + src_bytes > p.cap:
            p.deferred += 1
            return False
        if copies:
            assert dst is not None
            if not self._take_slot(dst):
                p.deferred += 1
                return False
            p.moved += src_bytes
        p.projected -= src_bytes
        if copies:
            assert dst is not None
            p.projected += self.level_bytes[dst]
        self.moving[b] = True
        self.cached.discard(b)
        if kind == EVICT and self.prefix_aware and self.indexed[b]:
            p.parked.append((b, self._park(b)))
        p.moves.append((b, kind, src, dst))
        return True

    def _move_live_blocks(self, p: _Pass, wishes: list[tuple[int, int, bool]]) -> None:
        down: list[tuple[Key, int, int]] = []
        lb, level, key = self.level_bytes, self.level, self._key
        for b, lv, _ in wishes:
            if not self._movable(b) or lb[level[b]] == 0:
                continue
            if level[b] > lv:
                # One tier, so no higher-precision copy: a promotion is a no-op, counted.
                p.noop += 1
            elif level[b] < lv:
                down.append((key(b), b, lv))
        down.sort()
        for _, b, lv in down:
            self._push_move(p, b, DROP if lv == self.drop_level else DEMOTE, lv)

    def _relieve_pressure(self, p: _Pass, wishes: list[tuple[int, int, bool]]) -> int:
        """Pass 3: soft actions first, lowest key first among the cached blocks of the levels
        they can be demoted from and the unprotected live blocks: demote one level; above the
        budget itself, a live block that cannot be demoted is dropped (with a drop level).
        Above the budget, with none of that left: evictions, lowest first (see
        :meth:`_lowest_evictable`). Returns the bytes still over the budget."""
        budget = self.budget
        if budget is None:
            return 0
        soft = int(budget * (1.0 - self.headroom))
        last_kept, lb, level = self.last_kept, self.level_bytes, self.level
        demotable = self.enable_compression and last_kept > 0
        # Where nothing can be demoted, only evicting above the budget itself applies.
        if p.projected <= (soft if demotable else budget):
            return 0
        key = self._key
        live = [
            (key(b), b)
            for b, _, prot in wishes
            if not prot and self._movable(b) and lb[level[b]] > 0
        ]
        live.sort(reverse=True)  # pop() takes the lowest
        demote_from = [lv for lv in range(len(lb)) if demotable and lv < last_kept]
        aside: set[int] = set()  # cached blocks no move fits, for the rest of the pass
        skipped: list[tuple[Key, int]] = []  # live blocks no soft action fits, for the hard pass
        hard = False

        def go_hard() -> None:
            nonlocal hard
            hard = True
            live.extend(skipped)
            skipped.clear()
            live.sort(reverse=True)

        while p.projected > (budget if hard else soft):
            # A chain's end goes after every other cached block, a sink last; against live
            # blocks, by key alone.
            ranked: tuple[int, Key, int] | None = None
            for b in self.cached:
                if level[b] in demote_from and b not in aside:
                    c = (self._end(b), key(b), b)
                    if ranked is None or c < ranked:
                        ranked = c
            cached = None if ranked is None else ranked[1:]
            if cached is not None and (not live or cached < live[-1]):
                b, is_live = cached[1], False
            elif live:
                b, is_live = live.pop()[1], True
            elif not hard:
                go_hard()
                continue
            else:
                break
            lv = level[b]
            if demotable and lv < last_kept:
                acted = self._push_move(p, b, DEMOTE, lv + 1)
            elif hard and is_live and self.drop_level is not None:
                acted = self._push_move(p, b, DROP, self.drop_level)
            else:
                acted = False
            if acted:
                continue
            if is_live and not hard:
                skipped.append((key(b), b))
            elif not is_live:
                # The move cap or a full pool stopped a copy: the headroom is given up for this
                # plan, and the block waits for the evictions.
                if not hard:
                    go_hard()
                aside.add(b)
        # Above the budget itself, with nothing left to demote or drop: evictions.
        every_level = range(len(lb))
        while p.projected > budget:
            b_evict = self._lowest_evictable(every_level)
            if b_evict is None:
                return p.projected - budget
            self._push_move(p, b_evict, EVICT, None)
        return 0

    def _take_pending(self, plan_id: int) -> ModelPlan:
        if self.pending is None or self.pending.id != plan_id:
            raise PlanError(f"no pending plan with id {plan_id}")
        plan, self.pending = self.pending, None
        return plan

    def commit(self, plan_id: int) -> None:
        """Applies the pending plan: sources are freed now."""
        plan = self._take_pending(plan_id)
        c = self.counters
        parked = iter(plan.parked)
        next_parked = next(parked, None)
        for b, kind, src, dst in plan.moves:
            # Parked (a prefix-aware eviction of an indexed block): its parent's hash.
            was_parked, parent_hash = False, None
            if next_parked is not None and next_parked[0] == b and kind == EVICT:
                was_parked, parent_hash = True, next_parked[1]
                next_parked = next(parked, None)
            # Pinned meanwhile, or an eviction of a block shared again (or given an indexed
            # child: no leaf any more) meanwhile: cancelled, and a parked block linked back.
            reshared = kind == EVICT and (self.refcount[b] > 0 or bool(self.children[b]))
            if self.pins[b] > 0 or reshared:
                if kind == DEMOTE:
                    assert dst is not None
                    self._give_slot(dst)
                self.moving[b] = False
                c["cancelled_moves"] += 1
                if was_parked:
                    self._unpark(b, parent_hash)
                continue
            if kind == EVICT:
                self.moving[b] = False
                self._evict_now(b)
                continue
            assert dst is not None
            self._give_slot(src)
            self.level[b] = dst
            if kind == DROP:
                self._leave_prefix_index(b)  # with its descendants: they could never load
                c["drops"] += 1
            else:
                c["demotions"] += 1
                c["bytes_moved"] += self.level_bytes[src]
            self.moving[b] = False
        self._settle(plan)

    def abort(self, plan_id: int) -> None:
        """Drops the pending plan: destinations are freed, every block stays where it was (a
        parked one linked back into its tree)."""
        plan = self._take_pending(plan_id)
        for b, kind, _, dst in plan.moves:
            if kind == DEMOTE:
                assert dst is not None
                self._give_slot(dst)
            self.moving[b] = False
        for b, parent_hash in reversed(plan.parked):
            self._unpark(b, parent_hash)
        self.counters["aborts"] += 1
        self._settle(plan)

    def _settle(self, plan: ModelPlan) -> None:
        for b, _, _, _ in plan.moves:
            if self.live[b]:
                self._refresh(b)
                self._release_if_orphan(b)


def _as_list(x: Iterable[Any]) -> list[Any]:
    tolist = getattr(x, "tolist", None)
    return list(tolist()) if tolist is not None else list(x)
