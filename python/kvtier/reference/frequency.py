"""How often each block hash came back, as the core measures it (``crates/kvtier/src/core/
frequency.rs``, whose docs say why): what a prefix-aware core under ``importance`` evicts by.
The same steps in the same order, so the float sums and quantiles come out bit for bit."""

from __future__ import annotations

import math
from collections import deque

CLASSES = 8
NEVER = 1 << 62
MEMORY = 1 << 17
UPDATE_EVERY = 1 << 13
DECAY = 0.9
EXPIRY_QUANTILE = 0.9
YOUNG_QUANTILE = 0.25
MIN_SAMPLES = 100.0
CHANCE_STEP = 0.01


def age_bucket(age: int) -> int:
    """Exact below 8, then four buckets an octave."""
    if age < 8:
        return age
    e = age.bit_length() - 1
    return 4 * (e - 1) + ((age >> (e - 2)) & 3)


def bucket_start(b: int) -> int:
    return b if b < 8 else (4 + b % 4) << (b // 4 - 1)


BUCKETS = age_bucket(1 << 40) + 1


def quantile(hist: list[float], q: float, min_samples: float = MIN_SAMPLES) -> int:
    """The age below which a share ``q`` of the distances in ``hist`` fall (``NEVER`` with
    ``min_samples`` or fewer to say)."""
    total = 0.0
    for n in hist:  # in order, as the core's iterator sums
        total += n
    if total <= min_samples:
        return NEVER
    acc = 0.0
    for b, n in enumerate(hist):
        acc += n
        if acc >= q * total:
            return bucket_start(b + 1)
    return NEVER


def reuse_chances(hist: list[float], entered: float, horizon: int) -> list[float]:
    """A class's chance of a reuse within ``horizon`` more ticks by idle age bucket, in steps of
    ``CHANCE_STEP`` rounded down (the core's ``reuse_chances``)."""
    before = [0.0]
    for n in hist:
        before.append(before[-1] + n)
    chance = []
    for b in range(BUCKETS):
        waiting = entered - before[b]
        if entered <= MIN_SAMPLES or waiting <= 0.0:
            chance.append(0.0)
            continue
        end = (
            BUCKETS if horizon == NEVER else min(age_bucket(bucket_start(b) + horizon) + 1, BUCKETS)
        )
        p = min((before[end] - before[b]) / waiting, 1.0)
        chance.append(math.floor(p / CHANCE_STEP) * CHANCE_STEP)
    return chance


class Frequency:
    """The sightings of block hashes and the ages measured from them."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, int]] = {}  # hash -> (tick of last sighting, count)
        self.forget: deque[tuple[int, int]] = deque()  # (tick, hash), oldest first
        self.reuse = [[0.0] * BUCKETS for _ in range(CLASSES)]
        self.entered = [0.0] * CLASSES  # blocks that entered each class
        self.evicted_idle = 0.0  # idle ages of the evicted leaves, summed
        self.evicted_count = 0.0
        self.expiry = [NEVER] * CLASSES
        self.chance = [[0.0] * BUCKETS for _ in range(CLASSES)]
        self.young_age = NEVER
        self.next_update = UPDATE_EVERY

    def seen(self, h: int, now: int) -> int:
        """Counts a sighting of hash ``h`` at tick ``now``; returns the block's class."""
        while self.forget and now - self.forget[0][0] > MEMORY:
            tick, old = self.forget.popleft()
            if self.last.get(old, (None,))[0] == tick:
                del self.last[old]
        count = 0
        if h in self.last:
            tick, count = self.last[h]
            self.reuse[min(count - 1, CLASSES - 1)][age_bucket(now - tick)] += 1.0
        self.last[h] = (now, count + 1)
        cls = min(count, CLASSES - 1)
        self.entered[cls] += 1.0
        self.forget.append((now, h))
        if now >= self.next_update:
            self._update()
            self.next_update = now + UPDATE_EVERY
        return cls

    def evicted(self, idle: int) -> None:
        """Counts an evicted block, idle ``idle`` ticks when it went."""
        self.evicted_idle += float(idle)
        self.evicted_count += 1.0

    def _update(self) -> None:
        self.expiry = [quantile(hist, EXPIRY_QUANTILE) for hist in self.reuse]
        self.young_age = quantile(self.reuse[0], YOUNG_QUANTILE)
        horizon = int(self.evicted_idle / self.evicted_count) if self.evicted_count > 0.0 else NEVER
        self.chance = [
            reuse_chances(hist, entered, horizon)
            for hist, entered in zip(self.reuse, self.entered, strict=True)
        ]
        for hist in self.reuse:
            hist[:] = [n * DECAY for n in hist]
        self.entered = [n * DECAY for n in self.entered]
        self.evicted_idle *= DECAY
        self.evicted_count *= DECAY

    def rank(
        self, cls: int, last_access: int, released: bool, now: int
    ) -> tuple[float, float, int]:
        """What a cached leaf is evicted by, lowest first (the core's ``Frequency::rank``)."""
        if released:
            return (-float("inf"), -float("inf"), last_access)
        idle = max(now - last_access, 0)
        if cls > 0 and idle <= self.expiry[cls]:
            return (1.0 + cls, 0.0, last_access)  # above any chance
        return (self.chance[cls][min(age_bucket(idle), BUCKETS - 1)], 0.0, last_access)

    def young_first(self, cls: int, last_access: int, released: bool, now: int) -> bool:
        """Whether the youngest first-seen leaf goes instead of this one."""
        return cls == 0 and not released and max(now - last_access, 0) < self.young_age
