//! Which values a keyed byte store (host memory, a disk directory) evicts to stay within its byte
//! budget, ranked by the core's policies with the core's keys and eviction queue.
//!
//! A store sees less than the scheduler: its signals are the accesses (each put and get of a
//! key) and, where the caller reports one, a score per key. So `lru` ranks by last access,
//! `lfu` by decayed access count (decayed once per batch, a store's step), and the policies that
//! rank by a measured signal (`importance`, `h2o`, `scissorhands`) by the caller's score, then
//! as `lfu`. A key never scored ranks with score 0, below every scored key with a positive score.
//!
//! Keys that name blocks of a prefix (a block's value is worth loading only while every block
//! before it is held) may be linked to the key before them (`set_parents`): eviction then takes
//! leaves only, as the core's does, so no value is stranded behind an evicted one. A link holds
//! while both keys do; removing a key with children unlinks them (their parent is gone).

// foldhash, not SipHash: a store looks a key up on every put and get (keys are namespaced block
// hashes; foldhash is seeded per process).
use foldhash::HashMap;

use crate::config::PolicyKind;
use crate::error::{Error, Result};
use crate::evict::{EvictionQueue, Ticket};
use crate::stats::DecayTable;
use crate::types::Key;

#[derive(Debug, Clone)]
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
    /// The row of the key before this one in a prefix, while `parent_life` is its `life`.
    parent: u32,
    parent_life: u32,
    /// Bumped when the row is freed: links to its former key read stale.
    life: u32,
    /// Keys linked to this one as their parent (it is evicted only once none is left).
    children: u32,
}

const NO_ROW: u32 = u32::MAX;

impl Default for Row {
    fn default() -> Self {
        Row {
            key: String::new(),
            bytes: 0,
            reads: 0.0,
            reads_step: 0,
            last_access: 0,
            score: 0.0,
            version: 0,
            live: false,
            parent: NO_ROW,
            parent_life: 0,
            life: 0,
            children: 0,
        }
    }
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
    /// the lowest-ranked other keys until it fits (leaves first). Returns the evicted keys,
    /// lowest first, or `None`, with nothing changed, when the value is larger than the whole
    /// budget less what the keys before it in its prefix hold (they stay while it does).
    pub fn admit(&mut self, key: &str, bytes: u64) -> Option<Vec<String>> {
        let mut kept = 0;
        let mut at = self.by_key.get(key).and_then(|&r| self.parent_of(r));
        while let Some(a) = at {
            kept += self.rows[a as usize].bytes;
            at = self.parent_of(a);
        }
        if bytes.saturating_add(kept) > self.budget {
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

    /// Forgets `key`; returns the bytes it held. Its parent may become a leaf; its children
    /// lose their link.
    pub fn remove(&mut self, key: &str) -> Option<u64> {
        let r = self.by_key.remove(key)?;
        if let Some(p) = self.parent_of(r) {
            let parent = &mut self.rows[p as usize];
            parent.children -= 1;
            if parent.children == 0 {
                self.rank(p); // a leaf now: back in the queue
            }
        }
        let row = &mut self.rows[r as usize];
        row.live = false;
        row.version = row.version.wrapping_add(1);
        row.life = row.life.wrapping_add(1);
        (row.parent, row.children) = (NO_ROW, 0);
        row.key.clear();
        self.bytes -= row.bytes;
        self.free_rows.push(r);
        Some(row.bytes)
    }

    /// The row of the key `r`'s key is linked to, while both are held.
    fn parent_of(&self, r: u32) -> Option<u32> {
        let row = &self.rows[r as usize];
        let p = row.parent;
        (p != NO_ROW && self.rows[p as usize].life == row.parent_life).then_some(p)
    }

    /// Links each key to the key before it in a prefix (`parents[i]` before `keys[i]`): a key
    /// with children is evicted only after them. Pairs whose keys are not both held, a key
    /// linked already, and a link that would close a cycle are skipped.
    pub fn set_parents<S: AsRef<str>>(&mut self, keys: &[S], parents: &[S]) -> Result<()> {
        if keys.len() != parents.len() {
            return Err(Error::LengthMismatch {
                what: "parents",
                expected: keys.len(),
                got: parents.len(),
            });
        }
        for (key, parent) in keys.iter().zip(parents) {
            let (Some(&c), Some(&p)) = (
                self.by_key.get(key.as_ref()),
                self.by_key.get(parent.as_ref()),
            ) else {
                continue;
            };
            if self.parent_of(c).is_some() {
                continue;
            }
            // `p`'s ancestors must not include `c` (nor `p` be `c`).
            let mut at = Some(p);
            while let Some(a) = at {
                if a == c {
                    break;
                }
                at = self.parent_of(a);
            }
            if at.is_some() {
                continue;
            }
            let life = self.rows[p as usize].life;
            let child = &mut self.rows[c as usize];
            (child.parent, child.parent_life) = (p, life);
            self.rows[p as usize].children += 1; // no leaf: its queue entries read stale
        }
        Ok(())
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

    /// The keys in eviction order, lowest first (what `admit` would evict next): the lowest
    /// leaf, then the lowest of the leaves left, a parent becoming one when its last child goes.
    pub fn eviction_order(&self) -> Vec<String> {
        use std::cmp::Reverse;
        let mut children: HashMap<u32, u32> = HashMap::default();
        let mut leaves = std::collections::BinaryHeap::new();
        for &r in self.by_key.values() {
            match self.rows[r as usize].children {
                0 => leaves.push(Reverse((self.key(r), r))),
                n => _ = children.insert(r, n),
            }
        }
        let mut order = Vec::with_capacity(self.by_key.len());
        while let Some(Reverse((_, r))) = leaves.pop() {
            order.push(self.rows[r as usize].key.clone());
            if let Some(p) = self.parent_of(r) {
                let n = children.get_mut(&p).expect("a parent counts its children");
                *n -= 1;
                if *n == 0 {
                    leaves.push(Reverse((self.key(p), p)));
                }
            }
        }
        order
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

    /// Whether a queue entry stands for its row: live, its version, and a leaf.
    fn current(rows: &[Row], t: &Ticket) -> bool {
        let row = &rows[t.block as usize];
        row.live && row.version == t.version && row.children == 0
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

    /// Linked keys go leaf first: a prefix loses its tail, never a block in its middle, and a
    /// parent becomes a leaf when its last child goes.
    #[test]
    fn linked_keys_are_evicted_leaf_first() {
        let mut ix = index(PolicyKind::Lru, 40);
        for k in ["a", "b", "c", "x"] {
            ix.admit(k, 10);
        }
        // a <- b <- c (c the tail), x alone; by recency a would go first.
        ix.set_parents(&["b", "c"], &["a", "b"]).unwrap();
        assert_eq!(ix.eviction_order(), ["c", "b", "a", "x"]);
        assert_eq!(
            ix.admit("y", 20),
            Some(vec!["c".to_owned(), "b".to_owned()])
        );
        assert!(ix.contains("a") && ix.contains("x"));
        // a leaf again: it goes next, before x
        assert_eq!(ix.admit("z", 10), Some(vec!["a".to_owned()]));
        // a link needs both keys held, is made once, and never closes a cycle
        ix.set_parents(&["y", "z", "y"], &["x", "y", "z"]).unwrap();
        assert_eq!(ix.eviction_order(), ["z", "y", "x"]);
        assert!(ix.set_parents(&["y"], &[]).is_err());
        // Removing a key with children unlinks them; the row reused keeps no link.
        ix.remove("y");
        assert_eq!(ix.eviction_order(), ["x", "z"]);
        ix.admit("w", 10);
        assert_eq!(ix.eviction_order(), ["x", "z", "w"]);
    }

    /// A key's new value never evicts the keys before it: room only they hold refuses it.
    #[test]
    fn a_replacement_keeps_its_prefix() {
        let mut ix = index(PolicyKind::Lru, 30);
        ix.admit("a", 10);
        ix.admit("b", 10);
        ix.set_parents(&["b"], &["a"]).unwrap();
        assert_eq!(ix.admit("b", 25), None, "a must stay while b is held");
        assert_eq!((ix.len(), ix.used_bytes()), (2, 20));
        assert_eq!(ix.admit("b", 20), Some(vec![]));
        // Another key's room: the leaf b goes, not a (older, but b's parent).
        assert_eq!(ix.admit("c", 10), Some(vec!["b".to_owned()]));
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
