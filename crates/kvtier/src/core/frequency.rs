//! How often each prefix block comes back, measured online: what a prefix-aware core under
//! `importance` evicts by ([`Frequency`]). Modelled first in `benchmarks/policy_lab.py`
//! (`freq`), where it beat LRU, vLLM's ARC and LRU with admission on the conversation trace.
//!
//! A block's *class* is how many times before a sequence took its hash (capped at
//! `CLASSES - 1`), remembered past the block's eviction for a while (a ghost of hashes).
//! Eviction's candidates are the least recently used leaf of each class; which of them goes
//! follows what the core measures: the reuse distances (access-clock ticks between two
//! sightings) of each class in a decayed histogram, how many blocks entered each class, and
//! the *horizon*, the mean idle age of the leaves evicted (how long this cache, at this size
//! and load, keeps a block nobody reads):
//! - a block seen before, idle less than its class's 0.9-quantile, is kept: its conversation
//!   is likely going on (the highest class first);
//! - the others (first-seen, or idle past that quantile: the conversation likely ended) rank
//!   by their class's measured chance of a reuse within one horizon, given the idle age they
//!   reached, to the percentage point; ties go least recently used first. In a small cache
//!   that keeps the first-seen blocks about to come back; in a large one, whose horizon
//!   outlasts most conversations, it ranks nearly as LRU does, which is what wins there;
//! - when the leaf to go is a first-seen block younger than a quarter of the first-seen
//!   blocks' reuse distances, it would likely be gone before its reuse anyway: the youngest
//!   first-seen leaf goes instead (admission by eviction order; with too few distances
//!   measured, always).
//!
//! The reference model (`kvtier.reference.core`) does the same, step for step.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use super::blocks::BlockRow;
use super::IdHasher;
use crate::types::Key;

/// Classes of sightings: 0 (first seen) to `CLASSES - 1` (seen that often or more).
pub(crate) const CLASSES: usize = 8;
/// An age nothing reaches: the quantile of a histogram with too few distances to say.
pub(crate) const NEVER: u64 = 1 << 62;
/// Four buckets an octave up to 2^40 ticks.
const BUCKETS: usize = age_bucket(1 << 40) + 1;
/// Ticks a sighting is remembered after it. These constants are one setting for every
/// workload, chosen on the conversation trace and its bundled slice: their neighbours (memory
/// 2^17 to 2^19, updates every 2^12 to 2^14, young quantile 0.2 to 0.3, 20 to 400 samples)
/// move the hit rate by hundredths to a few tenths of a point at each capacity; an expiry
/// quantile of 0.95 costs up to 0.6 points at 20k blocks. Chances ranked to the thousandth
/// rather than the hundredth cost 0.03 points at 50k blocks; to the twentieth, 0.4 at 35k.
/// (Ranking an expired block's ties as if read its expiry later, as the rule before the
/// chances did, costs 0.1 point against LRU with the ladder at 25k-35k blocks.)
const MEMORY: u64 = 1 << 17;
/// Ticks between updates of the ages the rules compare with (then the histograms decay).
const UPDATE_EVERY: u64 = 1 << 13;
const DECAY: f64 = 0.9;
const EXPIRY_QUANTILE: f64 = 0.9;
const YOUNG_QUANTILE: f64 = 0.25;
/// Distances a histogram needs (decayed) before its quantiles say anything.
const MIN_SAMPLES: f64 = 100.0;
/// Chances of a reuse closer than this are a tie (recency decides).
const CHANCE_STEP: f64 = 0.01;

/// The bucket of an age: exact below 8, then four per octave.
pub(crate) const fn age_bucket(age: u64) -> usize {
    if age < 8 {
        return age as usize;
    }
    let e = 63 - age.leading_zeros() as usize;
    4 * (e - 1) + ((age >> (e - 2)) & 3) as usize
}

/// The smallest age of bucket `b`.
const fn bucket_start(b: usize) -> u64 {
    if b < 8 {
        b as u64
    } else {
        (4 + (b % 4) as u64) << (b / 4 - 1)
    }
}

/// The age below which a share `q` of the distances in `hist` fall (`NEVER` with too few).
fn quantile(hist: &[f64; BUCKETS], q: f64) -> u64 {
    let total: f64 = hist.iter().sum();
    if total <= MIN_SAMPLES {
        return NEVER;
    }
    let mut acc = 0.0;
    for (b, n) in hist.iter().enumerate() {
        acc += n;
        if acc >= q * total {
            return bucket_start(b + 1);
        }
    }
    NEVER
}

/// Fills `chance` with the chance that a block of a class (whose reuse distances are `hist`,
/// `entered` blocks entered it) idle since the start of each age bucket is reused within
/// `horizon` more ticks: the reuses in that window over the blocks not reused before it, in
/// steps of `CHANCE_STEP`, rounded down. With too few blocks measured, 0 everywhere.
fn reuse_chances(chance: &mut [f64; BUCKETS], hist: &[f64; BUCKETS], entered: f64, horizon: u64) {
    let mut before = [0.0; BUCKETS + 1]; // reuses at ages below each bucket
    for b in 0..BUCKETS {
        before[b + 1] = before[b] + hist[b];
    }
    for b in 0..BUCKETS {
        let waiting = entered - before[b];
        if entered <= MIN_SAMPLES || waiting <= 0.0 {
            chance[b] = 0.0;
            continue;
        }
        let end = if horizon == NEVER {
            BUCKETS
        } else {
            (age_bucket(bucket_start(b) + horizon) + 1).min(BUCKETS)
        };
        let p = ((before[end] - before[b]) / waiting).min(1.0);
        chance[b] = (p / CHANCE_STEP).floor() * CHANCE_STEP;
    }
}

/// The sightings of block hashes and the ages measured from them (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Frequency {
    /// Each remembered hash: the tick of its last sighting and how many it had.
    last: HashMap<u64, (u64, u32), BuildHasherDefault<IdHasher>>,
    /// (tick, hash) of every sighting, oldest first: what to forget when.
    forget: VecDeque<(u64, u64)>,
    reuse: Box<[[f64; BUCKETS]; CLASSES]>,
    /// Blocks that entered each class (sightings), decayed with `reuse`.
    entered: [f64; CLASSES],
    /// Idle ages of the evicted leaves, summed, and their number, decayed with `reuse`.
    evicted_idle: f64,
    evicted: f64,
    expiry: [u64; CLASSES],
    /// Each class's chance of a reuse within the horizon by idle age bucket, in steps.
    chance: Box<[[f64; BUCKETS]; CLASSES]>,
    young_age: u64,
    next_update: u64,
}

impl Default for Frequency {
    fn default() -> Self {
        Frequency {
            last: HashMap::default(),
            forget: VecDeque::new(),
            reuse: Box::new([[0.0; BUCKETS]; CLASSES]),
            entered: [0.0; CLASSES],
            evicted_idle: 0.0,
            evicted: 0.0,
            expiry: [NEVER; CLASSES],
            chance: Box::new([[0.0; BUCKETS]; CLASSES]),
            young_age: NEVER,
            next_update: UPDATE_EVERY,
        }
    }
}

impl Frequency {
    /// Counts a sighting of `hash` (a sequence took its block) at tick `now`; returns the
    /// block's class.
    pub(crate) fn seen(&mut self, hash: u64, now: u64) -> u8 {
        while let Some(&(tick, h)) = self.forget.front() {
            if now - tick <= MEMORY {
                break;
            }
            self.forget.pop_front();
            if let Entry::Occupied(last) = self.last.entry(h) {
                if last.get().0 == tick {
                    last.remove(); // not seen since: forgotten
                }
            }
        }
        let count = match self.last.entry(hash) {
            Entry::Occupied(mut last) => {
                let (tick, count) = *last.get();
                let before = (count as usize - 1).min(CLASSES - 1);
                self.reuse[before][age_bucket(now - tick)] += 1.0;
                *last.get_mut() = (now, count + 1);
                count
            }
            Entry::Vacant(last) => {
                last.insert((now, 1));
                0
            }
        };
        let class = (count as usize).min(CLASSES - 1);
        self.entered[class] += 1.0;
        self.forget.push_back((now, hash));
        if now >= self.next_update {
            self.update();
            self.next_update = now + UPDATE_EVERY;
        }
        class as u8
    }

    /// Counts an evicted block, idle `idle` ticks when it went.
    pub(crate) fn evicted(&mut self, idle: u64) {
        self.evicted_idle += idle as f64;
        self.evicted += 1.0;
    }

    fn update(&mut self) {
        for (expiry, hist) in self.expiry.iter_mut().zip(self.reuse.iter()) {
            *expiry = quantile(hist, EXPIRY_QUANTILE);
        }
        self.young_age = quantile(&self.reuse[0], YOUNG_QUANTILE);
        let horizon = if self.evicted > 0.0 {
            (self.evicted_idle / self.evicted) as u64
        } else {
            NEVER
        };
        for ((chance, hist), &entered) in self
            .chance
            .iter_mut()
            .zip(self.reuse.iter())
            .zip(&self.entered)
        {
            reuse_chances(chance, hist, entered, horizon);
        }
        for n in self.reuse.iter_mut().flatten() {
            *n *= DECAY;
        }
        for n in &mut self.entered {
            *n *= DECAY;
        }
        self.evicted_idle *= DECAY;
        self.evicted *= DECAY;
    }

    /// What a cached leaf is evicted by at tick `now`, lowest first: a released one first;
    /// else, seen before and idle within its class's expiry, above every other, by class and
    /// last access; else by its chance of a reuse within the horizon, then last access.
    #[inline]
    pub(crate) fn rank(&self, row: &BlockRow, now: u64) -> Key {
        if row.released {
            return Key::first(row.last_access);
        }
        let class = usize::from(row.class);
        let idle = now.saturating_sub(row.last_access);
        let primary = if class > 0 && idle <= self.expiry[class] {
            1.0 + class as f64 // above any chance
        } else {
            self.chance[class][age_bucket(idle).min(BUCKETS - 1)]
        };
        Key::new(primary, 0.0, row.last_access)
    }

    /// Whether the youngest first-seen leaf goes instead of `row`, the leaf eviction ranks
    /// lowest at tick `now`: a first-seen block too young to be reused before it would go.
    #[inline]
    pub(crate) fn young_first(&self, row: &BlockRow, now: u64) -> bool {
        row.class == 0 && !row.released && now.saturating_sub(row.last_access) < self.young_age
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn age_buckets_cover_every_age_once_in_order() {
        for age in (0..4096).chain([12_345, 1 << 30, (1 << 40) - 1]) {
            let b = age_bucket(age);
            assert!(bucket_start(b) <= age && age < bucket_start(b + 1), "{age}");
        }
        assert!(age_bucket((1 << 40) - 1) < BUCKETS);
    }

    #[test]
    fn classes_count_sightings_and_are_forgotten_after_memory() {
        let mut f = Frequency::default();
        assert_eq!(f.seen(7, 1), 0);
        assert_eq!(f.seen(7, 2), 1);
        assert_eq!(f.seen(9, 3), 0);
        for t in 4..20 {
            f.seen(7, t);
        }
        assert_eq!(f.seen(7, 20), (CLASSES - 1) as u8);
        // Long after its last sighting, a hash is first-seen again.
        assert_eq!(f.seen(7, 21 + MEMORY), 0);
        assert_eq!(f.seen(9, 22 + MEMORY), 0);
    }

    #[test]
    fn chances_count_the_reuses_within_the_horizon_among_the_blocks_still_waiting() {
        // 400 blocks entered, 100 of them reused 100 ticks later.
        let mut hist = [0.0; BUCKETS];
        hist[age_bucket(100)] = 100.0;
        let mut chance = [0.0; BUCKETS];
        reuse_chances(&mut chance, &hist, 400.0, 200);
        assert_eq!(chance[0], 0.25);
        assert_eq!(chance[age_bucket(101) + 1], 0.0); // past its reuse: nothing to wait for
        reuse_chances(&mut chance, &hist, 400.0, 25); // too short a horizon to reach it from 0
        assert_eq!(chance[0], 0.0);
        assert_eq!(chance[age_bucket(95)], 0.25); // but from 80 on (its bucket) it does
        reuse_chances(&mut chance, &hist, 50.0, NEVER); // too few blocks to say
        assert!(chance.iter().all(|&c| c == 0.0));
    }

    #[test]
    fn the_measured_distances_set_expiry_and_youth() {
        let mut f = Frequency::default();
        assert_eq!((f.expiry[0], f.young_age), (NEVER, NEVER));
        // Hashes seen twice, 100 ticks apart: first-seen blocks come back after 100.
        let mut now = 0;
        for h in 0..400 {
            f.seen(h, now);
            f.seen(h, now + 100);
            now += 101;
        }
        f.seen(1 << 40, now + UPDATE_EVERY);
        assert!(f.expiry[0] > 100 && f.expiry[0] <= 128, "{}", f.expiry[0]);
        assert_eq!(f.young_age, f.expiry[0]);
        assert_eq!(f.expiry[1], NEVER);
    }
}
