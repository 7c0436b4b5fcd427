//! Which values a keyed byte store (host memory, a disk directory) evicts to stay within its byte
//! budget, ranked by the core's policies with the core's keys and eviction queue.
//!
//! A store sees less than the scheduler: its signals are the accesses (each put and get of a
//! key) and, where the caller reports one, a score per key. So `lru` ranks by last access,
//! `lfu` by decayed access count (decayed once per batch, a store's step), and the policies that
//! rank by a measured signal (`importance`, `h2o`, `scissorhands`) by the caller's score, then
//! as `lfu`. A key never scored ranks with score 0, below every scored key with a positive score.

// foldhash, not SipHash: a store looks a key up on every put and get (keys are namespaced block
// hashes; foldhash is seeded per process).
use foldhash::HashMap;

use crate::config::PolicyKind;
use crate::core::Key;
use crate::error::{Error, Result};
use crate::evict::{EvictionQueue, Ticket};
use crate::stats::DecayTable;

#[derive(Debug, Clone, Default)]
struct Row {
    key: String,
    bytes: u64,
    reads: f32,
    reads_step: u32,
    last_access: u64,
    score: f32,
    /// Bumped on every re-rank and on removal, so older queue entries of the row read stale.
    version: u32,
    live: bool,
}

#[derive(Debug, Clone)]
pub struct StoreIndex {
    policy: PolicyKind,
    decay: DecayTable,
    budget: u64,
    bytes: u64,
    rows: Vec<Row>,
    free_rows: Vec<u32>,
    by_key: HashMap<String, u32>,
    queue: EvictionQueue,
    clock: u64,
    step: u32,
}

impl StoreIndex {
    pub fn new(policy: PolicyKind, budget: u64, decay: f32) -> Result<StoreIndex> {
        if !(decay > 0.0 && decay <= 1.0) {
            return Err(Error::InvalidArgument {
                what: "decay",
                reason: format!("{decay} is not in (0, 1]"),
            });
        }
        Ok(StoreIndex {
            policy,
            decay: DecayTable::new(decay),
            budget,
            bytes: 0,
            rows: Vec::new(),
            free_rows: Vec::new(),
            by_key: HashMap::default(),
            queue: EvictionQueue::default(),
            clock: 0,
            step: 0,
        })
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn used_bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.by_key.contains_key(key)
    }

    /// The bytes recorded for `key`.
    pub fn bytes_of(&self, key: &str) -> Option<u64> {
        self.by_key.get(key).map(|&r| self.rows[r as usize].bytes)
    }

    /// Records a value of `bytes` under `key` (replacing what the key held), first evicting
    /// the lowest-ranked other keys until it fits. Returns the evicted keys, lowest first, or
    /// `None`, with nothing changed, when the value is larger than the whole budget.
    pub fn admit(&mut self, key: &str, bytes: u64) -> Option<Vec<String>> {
        if bytes > self.budget {
            return None;
        }
        // A key already held gives its bytes back and keeps its row (a replacement allocates
        // nothing); out of the queue (its entries read stale), it is never evicted to make
        // room for itself.
        let held = self.by_key.get(key).copied();
        if let Some(r) = held {
            let row = &mut self.rows[r as usize];
            row.live = false;
            row.version = row.version.wrapping_add(1);
            self.bytes -= row.bytes;
        }
        let mut evicted = Vec::new();
        while self.bytes + bytes > self.budget {
            let victim = self.lowest().expect("bytes are held by some key");
            let row = &self.rows[victim as usize];
            evicted.push(row.key.clone());
            self.remove(&evicted[evicted.len() - 1]);
        }
        let r = held.unwrap_or_else(|| {
            let r = self.free_rows.pop().unwrap_or_else(|| {
                self.rows.push(Row::default());
                (self.rows.len() - 1) as u32
            });
            self.rows[r as usize].key.push_str(key); // a freed row's key keeps its buffer
            self.by_key.insert(key.to_owned(), r);
            r
        });
        self.clock += 1;
        let (step, clock) = (self.step, self.clock);
        let row = &mut self.rows[r as usize];
        row.bytes = bytes;
        row.reads = 1.0;
        row.reads_step = step;
        row.last_access = clock;
        row.score = 0.0;
        row.live = true;
        self.bytes += bytes;
        self.rank(r);
        Some(evicted)
    }

    /// Forgets `key`; returns the bytes it held.
    pub fn remove(&mut self, key: &str) -> Option<u64> {
        let r = self.by_key.remove(key)?;
        let row = &mut self.rows[r as usize];
        row.live = false;
        row.version = row.version.wrapping_add(1);
        row.key.clear();
        self.bytes -= row.bytes;
        self.free_rows.push(r);
        Some(row.bytes)
    }

    /// One batch of reads (a store's step): each known key's access count and recency.
    /// Unknown keys are skipped (a miss reads nothing).
    pub fn touch<S: AsRef<str>>(&mut self, keys: &[S]) {
        self.step = self.step.wrapping_add(1);
        for key in keys {
            let Some(&r) = self.by_key.get(key.as_ref()) else {
                continue;
            };
            self.clock += 1;
            let row = &mut self.rows[r as usize];
            row.reads = row.reads * self.decay.pow(self.step.wrapping_sub(row.reads_step)) + 1.0;
            row.reads_step = self.step;
            row.last_access = self.clock;
            self.rank(r);
        }
    }

    /// The caller's score of each key (its importance, accumulated attention or persistence):
    /// what `importance`, `h2o` and `scissorhands` rank by first. Unknown keys are skipped.
    pub fn set_scores<S: AsRef<str>>(&mut self, keys: &[S], scores: &[f32]) -> Result<()> {
        if keys.len() != scores.len() {
            return Err(Error::LengthMismatch {
                what: "scores",
                expected: keys.len(),
                got: scores.len(),
            });
        }
        if let Some(bad) = scores.iter().find(|s| !s.is_finite()) {
            return Err(Error::InvalidArgument {
                what: "scores",
                reason: format!("{bad} is not a finite number"),
            });
        }
        for (key, &score) in keys.iter().zip(scores) {
            if let Some(&r) = self.by_key.get(key.as_ref()) {
                self.rows[r as usize].score = score;
                self.rank(r);
            }
        }
        Ok(())
    }

    /// The keys in eviction order, lowest first (what `admit` would evict next).
    pub fn eviction_order(&self) -> Vec<String> {
        let mut ranked: Vec<(Key, u32)> = self.by_key.values().map(|&r| (self.key(r), r)).collect();
        ranked.sort_unstable();
        ranked
            .into_iter()
            .map(|(_, r)| self.rows[r as usize].key.clone())
            .collect()
    }

    fn key(&self, r: u32) -> Key {
        Self::key_of(self.policy, &self.decay, &self.rows[r as usize])
    }

    fn key_of(policy: PolicyKind, decay: &DecayTable, row: &Row) -> Key {
        let freq = || decay.log_count(row.reads, row.reads_step);
        match policy {
            PolicyKind::Lru => Key::new(0.0, 0.0, row.last_access),
            PolicyKind::Lfu => Key::new(freq(), 0.0, row.last_access),
            PolicyKind::Importance | PolicyKind::H2o | PolicyKind::Scissorhands => {
                Key::new(f64::from(row.score), freq(), row.last_access)
            }
        }
    }

    /// Queues the row under its current key; its older entries go stale.
    fn rank(&mut self, r: u32) {
        let key = self.key(r);
        let row = &mut self.rows[r as usize];
        row.version = row.version.wrapping_add(1);
        let ticket = Ticket {
            block: r,
            version: row.version,
        };
        self.queue.push(key, ticket);
        if self.queue.len() > 2 * self.by_key.len() + 1024 {
            let rows = &self.rows;
            self.queue.retain(|t| Self::current(rows, t));
        }
    }

    fn current(rows: &[Row], t: &Ticket) -> bool {
        let row = &rows[t.block as usize];
        row.live && row.version == t.version
    }

    fn lowest(&mut self) -> Option<u32> {
        let (rows, policy, decay) = (&self.rows, self.policy, &self.decay);
        self.queue
            .peek_valid(
                |t| Self::current(rows, t),
                |r| Self::key_of(policy, decay, &rows[r as usize]),
            )
            .map(|e| e.ticket.block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(policy: PolicyKind, budget: u64) -> StoreIndex {
        StoreIndex::new(policy, budget, 0.9).unwrap()
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut ix = index(PolicyKind::Lru, 30);
        for k in ["a", "b", "c"] {
            assert_eq!(ix.admit(k, 10), Some(vec![]));
        }
        ix.touch(&["a"]);
        assert_eq!(ix.admit("d", 10), Some(vec!["b".to_string()]));
        assert_eq!(ix.eviction_order(), ["c", "a", "d"]);
        assert_eq!(ix.used_bytes(), 30);
    }

    #[test]
    fn lfu_keeps_the_often_read() {
        let mut ix = index(PolicyKind::Lfu, 30);
        for k in ["a", "b", "c"] {
            ix.admit(k, 10);
        }
        ix.touch(&["a", "a", "b"]);
        ix.touch(&["a"]);
        // c was read least (only its put); then b (older than a's reads, fewer of them).
        assert_eq!(
            ix.admit("d", 20),
            Some(vec!["c".to_string(), "b".to_string()])
        );
        assert!(ix.contains("a") && ix.contains("d"));
    }

    #[test]
    fn score_policies_rank_by_the_callers_score_first() {
        for policy in [
            PolicyKind::Importance,
            PolicyKind::H2o,
            PolicyKind::Scissorhands,
        ] {
            let mut ix = index(policy, 30);
            for k in ["a", "b", "c"] {
                ix.admit(k, 10);
            }
            ix.touch(&["a", "a", "a"]);
            ix.set_scores(&["a", "b", "c"], &[0.1, 0.9, 0.5]).unwrap();
            assert_eq!(ix.eviction_order(), ["a", "c", "b"], "{policy:?}");
        }
    }

    #[test]
    fn replacing_a_key_frees_its_old_bytes_and_too_large_changes_nothing() {
        let mut ix = index(PolicyKind::Lru, 30);
        ix.admit("a", 20);
        ix.admit("b", 10);
        assert_eq!(ix.admit("a", 5), Some(vec![]));
        assert_eq!(ix.used_bytes(), 15);
        assert_eq!(ix.admit("big", 31), None);
        assert_eq!((ix.len(), ix.used_bytes()), (2, 15));
        assert_eq!(ix.remove("a"), Some(5));
        assert_eq!(ix.remove("a"), None);
        assert_eq!(ix.used_bytes(), 10);
    }

    #[test]
    fn a_replacement_that_needs_room_evicts_the_others_never_itself() {
        for policy in [PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::Importance] {
            let mut ix = index(policy, 30);
            for k in ["a", "b", "c"] {
                ix.admit(k, 10);
            }
            ix.touch(&["a", "a"]);
            // Growing `a` must evict `b` (then `c`), in rank order, never `a` itself.
            assert_eq!(ix.admit("a", 15), Some(vec!["b".to_owned()]), "{policy:?}");
            assert_eq!((ix.len(), ix.used_bytes()), (2, 25), "{policy:?}");
            assert_eq!(ix.admit("a", 30), Some(vec!["c".to_owned()]), "{policy:?}");
            assert_eq!(ix.eviction_order(), ["a"], "{policy:?}");
            ix.admit("d", 1);
            assert_eq!(ix.eviction_order(), ["d"], "{policy:?}");
        }
    }

    #[test]
    fn bad_scores_are_refused_whole() {
        let mut ix = index(PolicyKind::Importance, 30);
        ix.admit("a", 10);
        assert!(ix.set_scores(&["a"], &[1.0, 2.0]).is_err());
        assert!(ix.set_scores(&["a"], &[f32::NAN]).is_err());
        assert!(StoreIndex::new(PolicyKind::Lru, 1, 0.0).is_err());
    }

    #[test]
    fn churn_never_breaks_the_budget_and_compacts_the_queue() {
        let mut ix = index(PolicyKind::Lfu, 1000);
        let mut state = 7u64;
        for i in 0..20_000u64 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let key = format!("k{}", (state >> 33) % 300);
            if i % 3 == 0 {
                ix.touch(&[key.as_str()]);
            } else {
                ix.admit(&key, 1 + (state >> 50) % 40);
            }
            assert!(ix.used_bytes() <= 1000);
            let sum: u64 = ix.by_key.keys().map(|k| ix.bytes_of(k).unwrap()).sum();
            assert_eq!(sum, ix.used_bytes());
        }
        assert!(ix.queue.len() <= 2 * ix.len() + 1025);
    }
}
