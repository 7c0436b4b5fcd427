"""A fast model of the prefix-aware cache, for trying eviction policies before the core gets one.

`kvtier simulate` replays a trace through the real core; this replays it through a few hundred
lines of Python that model only what decides a hit: a block is cached or not, a request hits
the longest cached prefix of its blocks, the request's blocks are pinned while it runs, and
eviction takes leaves of the prefix trees only (one tree per first block). Under `lru` it gives
the core's `lru` hit for hit (`tests/test_policy_lab.py`), so a policy that wins here is worth
building into the core.

Policies:
- `lru`: the least recently used leaf goes first.
- `freq`: frequency classes with measured aging, three rules:
  1. A block's class is how often it has been seen (capped at `--classes` - 1), remembered past
     its eviction for `--memory` new blocks; eviction takes the least recently used leaf of
     the lowest class.
  2. A block idle longer than its class's `--quantile` of the reuse distances observed for that
     class (online, decayed as they age) has likely seen its conversation end: it ranks with
     the first-seen blocks, as if read that much later than it was.
  3. When the leaf to go is a first-seen block idle for less than `--young-quantile` of the
     first-seen blocks' reuse distances (so it would likely be evicted before its reuse
     anyway), the youngest first-seen leaf goes instead: admission, by eviction order, only
     where the cache is too small to catch a first-seen block's reuse.

- `admit`: issue 59's `LRU + admission` peer: a missed block is cached only the second time it is
  seen within the last 3 N new blocks (N the capacity).

The core's default, `importance`, evicts by `freq`'s rules (`crates/kvtier/src/core/frequency.rs`,
with ages on its access clock).

    python benchmarks/policy_lab.py ../shared/data/traces/mooncake_conversation.jsonl --policy lru,freq,admit

``--json`` prints the result as JSON; ``--save PATH`` writes it with the run's provenance
(command, date, commit, machine, versions).
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
from collections import deque
from collections.abc import Iterable, Sequence

from kvtier.reference.frequency import NEVER, age_bucket, quantile
from kvtier.results import add_save_option, save_if_asked

# Issue 59's bar on the conversation trace: the best of its table's columns at each capacity.
TARGETS = {
    500: 5.65,
    1000: 7.75,
    2000: 11.06,
    5000: 16.62,
    10000: 21.94,
    20000: 29.59,
    50000: 35.48,
}


def load_trace(path: str) -> list[list[int]]:
    """The block hashes of each request of a Mooncake-style JSONL trace (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


#: Distances a class's histogram needs before its quantiles count here (the core waits for 100).
LAB_SAMPLES = 50.0


class Lru:
    """One class; every leaf ranks by its last access."""

    classes = 1

    def seen(self, block: int, clock: int) -> int:
        """Counts a sighting of ``block`` at ``clock``; returns its class."""
        return 0

    def rank(self, cls: int, age: int, tick: int) -> tuple[int, int]:
        """What a leaf of class ``cls``, idle for ``age``, last read at ``tick``, is evicted
        by: the lowest first."""
        return (cls, tick)

    def young_first(self, age: int) -> bool:
        """Whether the youngest first-seen leaf goes in place of the eviction candidate, a
        first-seen block idle for ``age``."""
        return False

    def admits(self, block: int, clock: int) -> bool:
        """Whether ``block``, missed at new-block ``clock``, is cached at all."""
        return True


class Admit(Lru):
    """Issue 59's `LRU + admission` peer: a missed block is cached only the second time it is
    seen within the last ``window`` new blocks (3 N for a cache of N); else neither it nor
    the rest of its request is (a cached block's prefix is cached)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.missed: dict[int, int] = {}  # block -> new-block clock of its last miss

    def admits(self, block: int, clock: int) -> bool:
        last = self.missed.get(block)
        self.missed[block] = clock
        return last is not None and clock - last <= self.window


class Freq(Lru):
    """Frequency classes, aged by the measured reuse distances (see the module docstring)."""

    def __init__(
        self,
        classes: int = 8,
        quantile: float = 0.9,
        memory: int = 1 << 17,
        young_quantile: float = 0.25,
    ) -> None:
        self.classes, self.quantile, self.memory = classes, quantile, memory
        self.young_quantile = young_quantile
        self.sightings: dict[int, int] = {}
        self.last: dict[int, tuple[int, int]] = {}  # block -> (clock, class) at its last sighting
        self.forget: deque[tuple[int, int]] = deque()  # (clock, block), oldest first
        self.reuse = [[0.0] * (age_bucket(1 << 40) + 1) for _ in range(classes)]
        self.expiry = [NEVER] * classes
        # First-seen blocks younger than this are rarely read again yet (until measured: all).
        self.young_age = NEVER
        self.next_update = 4096

    def seen(self, block: int, clock: int) -> int:
        last = self.last.get(block)
        if last is not None:
            self.reuse[last[1]][age_bucket(clock - last[0])] += 1
        count = self.sightings.get(block, 0)
        self.sightings[block] = count + 1
        cls = min(count, self.classes - 1)
        self.last[block] = (clock, cls)
        self.forget.append((clock, block))
        while self.forget and clock - self.forget[0][0] > self.memory:
            t, b = self.forget.popleft()
            if self.last.get(b, (None,))[0] == t:
                del self.last[b], self.sightings[b]
        if clock >= self.next_update:
            self.update()
            self.next_update = clock + 4096
        return cls

    def update(self) -> None:
        """The ages that the rules compare with, from the reuse distances seen so far (which
        then decay: recent ones weigh most)."""
        for cls, hist in enumerate(self.reuse):
            self.expiry[cls] = quantile(hist, self.quantile, LAB_SAMPLES)
        self.young_age = quantile(self.reuse[0], self.young_quantile, LAB_SAMPLES)
        for hist in self.reuse:
            hist[:] = [n * 0.9 for n in hist]

    def rank(self, cls: int, age: int, tick: int) -> tuple[int, int]:
        if age <= self.expiry[cls]:
            return (cls, tick)
        # Past its class's expiry: with the first-seen blocks, as if read that much later.
        return (0, tick + self.expiry[cls] if cls else tick)

    def young_first(self, age: int) -> bool:
        return age < self.young_age


class PrefixCache:
    """Cached blocks in prefix trees; eviction takes leaves, by the policy's rank."""

    def __init__(self, capacity: int, policy: Lru) -> None:
        self.capacity, self.policy = capacity, policy
        self.entry: dict[int, tuple[int, int, int]] = {}  # block -> (class, clock, tick)
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        # The cached leaves of each class, oldest first, and the first-seen ones youngest first
        # (all of them may hold stale entries).
        self.queues: list[list[tuple[int, int]]] = [[] for _ in range(policy.classes)]
        self.young: list[tuple[int, int]] = []
        self.clock = 0  # new blocks so far: ages are measured in it
        self.tick = 0  # accesses so far: recency ranks by it
        self.hits = self.refs = 0

    def _queue(self, block: int) -> None:
        cls, _, tick = self.entry[block]
        heapq.heappush(self.queues[cls], (tick, block))
        if cls == 0:
            heapq.heappush(self.young, (-tick, block))

    def _front(self, queue: list[tuple[int, int]], sign: int, pinned: set[int]) -> int | None:
        """The first block of ``queue`` that is still a cached, unpinned leaf queued with its
        current access (``sign``: -1 for a youngest-first queue); stale entries are dropped."""
        while queue:
            tick, block = queue[0]
            entry = self.entry.get(block)
            leaf = entry and entry[2] == sign * tick and not self.children.get(block)
            if leaf and block not in pinned:
                return block
            heapq.heappop(queue)
        return None

    def _evict_one(self, pinned: set[int]) -> bool:
        candidates = (self._front(q, 1, pinned) for q in self.queues)
        ranked = [
            (self.policy.rank(cls, self.clock - clock, tick), block)
            for block in candidates
            if block is not None
            for cls, clock, tick in [self.entry[block]]
        ]
        if not ranked:
            return False
        _, block = min(ranked)
        cls, clock, _ = self.entry[block]
        if cls == 0 and self.policy.young_first(self.clock - clock):
            block = self._front(self.young, -1, pinned) or block
        del self.entry[block]
        parent = self.parent.pop(block)
        if parent is not None:
            self.children[parent] -= 1
            if not self.children[parent] and parent not in pinned:
                self._queue(parent)
        return True

    def request(self, blocks: Sequence[int]) -> None:
        hits = 0
        while hits < len(blocks) and blocks[hits] in self.entry:
            hits += 1
        self.refs += len(blocks)
        self.hits += hits
        admitted = hits
        for i in range(hits, len(blocks)):  # every miss is seen; the first refused ends it
            if self.policy.admits(blocks[i], self.clock + i - hits + 1) and admitted == i:
                admitted += 1
        self.clock += len(blocks) - admitted  # (the admitted ones count below)
        blocks = blocks[:admitted]
        pinned = set(blocks)
        if len(pinned) > self.capacity:
            return  # refused before anything changes (as the core's append): it cannot fit
        new = len(blocks) - hits
        while len(self.entry) + new > self.capacity:
            if not self._evict_one(pinned):  # every cached block but the pinned prefix can go
                raise RuntimeError("no leaf to evict: the model lost track of its cache")
        parent = None
        for i, block in enumerate(blocks):
            self.tick += 1
            self.clock += i >= hits
            self.entry[block] = (self.policy.seen(block, self.clock), self.clock, self.tick)
            if i >= hits:
                self.parent[block] = parent
                if parent is not None:
                    self.children[parent] = self.children.get(parent, 0) + 1
            parent = block
        for block in blocks:
            if not self.children.get(block):
                self._queue(block)

    def hit_rate(self) -> float:
        return 100.0 * self.hits / max(self.refs, 1)


def replay(trace: Iterable[Sequence[int]], capacity: int, policy: Lru) -> PrefixCache:
    cache = PrefixCache(capacity, policy)
    for blocks in trace:
        cache.request(blocks)
    return cache


def make_policy(name: str, args: argparse.Namespace, capacity: int) -> Lru:
    if name == "lru":
        return Lru()
    if name == "freq":
        return Freq(args.classes, args.quantile, args.memory, args.young_quantile)
    if name == "admit":
        return Admit(3 * capacity)
    raise SystemExit(f"error: unknown policy {name!r}; expected lru, freq or admit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--policy", default="lru,freq", help="comma-separated: lru, freq, admit")
    parser.add_argument("--capacities", default=",".join(map(str, TARGETS)), help="device blocks")
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--quantile", type=float, default=0.9)
    parser.add_argument("--memory", type=int, default=1 << 17, help="new blocks a sighting is kept")
    parser.add_argument("--young-quantile", type=float, default=0.25)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_save_option(parser)
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    capacities = [int(c) for c in args.capacities.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    if not args.json:
        print("blocks  " + "  ".join(f"{c:>7}" for c in capacities))
    for name in args.policy.split(","):
        rows = results[name] = []
        for c in capacities:
            cache = replay(trace, c, make_policy(name, args, c))
            rows.append(
                {"blocks": c, "hits": cache.hits, "refs": cache.refs, "hit_rate": cache.hit_rate()}
            )
        if not args.json:
            print(f"{name:<7} " + "  ".join(f"{r['hit_rate']:6.2f}%" for r in rows), flush=True)
    settings = {
        "classes": args.classes,
        "quantile": args.quantile,
        "memory": args.memory,
        "young_quantile": args.young_quantile,
    }
    out = {
        "trace": args.trace,
        "freq": settings,
        "targets": {"source": "issue 59", "block_hit_rate_percent": TARGETS},
        "results": results,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        targets = (f"{TARGETS[c]:6.2f}%" if c in TARGETS else "      -" for c in capacities)
        print("target  " + "  ".join(targets))
    save_if_asked(args, out, "python benchmarks/policy_lab.py", argv)


if __name__ == "__main__":
    main()
