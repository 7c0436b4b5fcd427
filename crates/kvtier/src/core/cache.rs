//! The cache index of each pool ([`PoolCache`]): its cached blocks in queues in key order (the
//! cached blocks by which end of their chain they are: none, the last blocks, a sink; the
//! cached leaves, for eviction), how many, and how many are reclaimable; with the functions
//! that keep it over the block table's parts, taken apart from `Core` so that a loop over many
//! blocks holds them at once: entering a block
//! ([`enqueue_if_cached`]), leaving ([`BlockRow::leave_cache`]), settling the reclaimable flags
//! up the prefix tree ([`settle_reclaimable`]) and a plain core's eviction pass
//! ([`pop_evictable`]).

use crate::config::PolicyKind;
use crate::evict::{EvictionQueue, Ticket};
use crate::prefix::PrefixIndex;
use crate::types::{Key, NO_BLOCK};

use super::blocks::{BlockRow, Link, NOT_CACHED};
use super::frequency::CLASSES;
use super::ranking::{with_policy_key, End, PoolMap, Ranking};

/// The cached blocks of one pool: how many, and queues in key order (which may also hold stale
/// entries): one per [`End`], what demotion and offload take (the chains' ends after all the
/// others, the sinks last); and the cached leaves, what eviction takes (prefix-aware cores; a
/// plain core evicts from the first, and has no ends),
/// one queue per class (see `frequency`: all in the first but under `importance`) and, under
/// `importance`, the first-seen ones youngest first too.
#[derive(Debug, Clone)]
pub(crate) struct PoolCache {
    /// By [`End`]: apart, not ranked above the others by a term of the key, because each
    /// queue's fast path wants keys that arrive in order, which a sink arriving first and a
    /// leaf last in each sequence would break.
    pub(super) ranked: [EvictionQueue; 3],
    pub(super) leaves: [EvictionQueue; CLASSES],
    pub(super) young: EvictionQueue,
    pub(super) count: u64,
    /// Of them, those evicting leaf after leaf can free (see `BlockRow::reclaimable`).
    pub(super) reclaimable: u64,
    slot_bytes: u64,
    /// Pushes left before the queues are next checked for piled-up stale entries.
    pushes_to_check: u64,
}

/// Which queue of a pool: every cached block (the ends after the others, see [`End`]), the
/// cached blocks of one kind of end (or of none), or the cached leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cached {
    Any,
    Ranked(End),
    Leaves,
}

impl PoolCache {
    pub(super) fn new(slot_bytes: u64) -> PoolCache {
        PoolCache {
            ranked: Default::default(),
            leaves: Default::default(),
            young: EvictionQueue::default(),
            count: 0,
            reclaimable: 0,
            slot_bytes,
            pushes_to_check: 1,
        }
    }

    /// The queue of the cached blocks of one kind of end, or of none.
    pub(super) fn queue(&mut self, end: End) -> &mut EvictionQueue {
        &mut self.ranked[end as usize]
    }

    /// Counts `n` blocks just queued; every so many pushes, drops the stale entries once they
    /// outnumber the live ones (keys change, and each change leaves one behind).
    #[inline(always)]
    pub(super) fn pushed(&mut self, rows: &[BlockRow], links: &[Link], p: usize, n: u64) {
        self.count += n;
        self.pushes_to_check = self.pushes_to_check.saturating_sub(n);
        if self.pushes_to_check == 0 {
            self.drop_stale_entries(rows, links, p);
        }
    }

    #[cold]
    #[inline(never)]
    fn drop_stale_entries(&mut self, rows: &[BlockRow], links: &[Link], p: usize) {
        let bound = 2 * self.count + 1024;
        for queue in &mut self.ranked {
            if queue.len() as u64 > bound {
                queue.retain(|e| entry_valid(rows, p, e));
            }
        }
        for queue in self.leaves.iter_mut().chain([&mut self.young]) {
            if queue.len() as u64 > bound {
                queue.retain(|e| leaf_valid(rows, links, p, e));
            }
        }
        // A push adds at most one entry to each queue: neither passes the bound sooner than
        // this (give or take the live count shrinking meanwhile, which the next check catches).
        let longest = self
            .ranked
            .iter()
            .chain([&self.young])
            .chain(&self.leaves)
            .map(EvictionQueue::len)
            .max()
            .unwrap_or(0) as u64;
        self.pushes_to_check = (bound + 1).saturating_sub(longest).max(1);
    }

    /// Bytes of the reclaimable blocks (derived: every block moving in or out would pay for a
    /// running sum).
    pub(super) fn reclaimable_bytes(&self) -> u64 {
        self.reclaimable * self.slot_bytes
    }
}

impl BlockRow {
    /// Takes the block out of its pool's cache index (`queues`), if it is in one: its entries
    /// go stale. Its `reclaimable` flag stays for the caller to settle.
    #[inline(always)]
    pub(super) fn leave_cache(&mut self, queues: &mut [PoolCache]) {
        if self.cached_in != NOT_CACHED {
            let q = &mut queues[self.cached_in as usize];
            q.count -= 1;
            q.reclaimable -= u64::from(self.reclaimable);
            self.cached_in = NOT_CACHED;
        }
    }
}

/// Brings block `b`'s `reclaimable` flag up to date (cached, and no indexed child that is not
/// reclaimable), and its ancestors' as far as the change reaches.
#[inline(always)]
pub(super) fn settle_reclaimable(
    rows: &mut [BlockRow],
    links: &mut [Link],
    queues: &mut [PoolCache],
    b: u32,
) {
    let mut b = b;
    loop {
        let row = &mut rows[b as usize];
        let now = row.cached_in != NOT_CACHED && links[b as usize].blockers == 0;
        if now == row.reclaimable {
            return;
        }
        row.reclaimable = now;
        if row.cached_in != NOT_CACHED {
            let q = &mut queues[row.cached_in as usize];
            if now {
                q.reclaimable += 1;
            } else {
                q.reclaimable -= 1;
            }
        }
        let parent = links[b as usize].parent;
        if !row.indexed || parent == NO_BLOCK {
            return;
        }
        let p = &mut links[parent as usize];
        if now {
            p.blockers -= 1;
        } else {
            p.blockers += 1;
        }
        b = parent;
    }
}

/// Enters block `b`, in no cache index, into its pool's if it is cached now: the queue of its
/// kind of chain end (ranked by its key), and the leaf queue too (by its eviction key) when
/// `leaves` (prefix-aware) and it is a leaf. Counts it (as reclaimable too if its flag says so;
/// the caller settles the flag). Takes the core's parts apart (rows, queues) so that a loop
/// over many blocks keeps them at hand instead of reloading them from the core after every
/// write.
#[inline(always)]
pub(super) fn enqueue_if_cached(
    rows: &mut [BlockRow],
    links: &[Link],
    queues: &mut [PoolCache],
    ranking: Ranking<'_>,
    pools: PoolMap,
    leaves: bool,
    b: u32,
) {
    let i = b as usize;
    let row = &rows[i];
    debug_assert_eq!(row.cached_in, NOT_CACHED);
    if !row.is_cached() {
        return;
    }
    let p = pools.of(row.loc.tier, row.loc.level);
    let key = ranking.key(i, row);
    let evict_key = ranking.evict_key(i, row);
    let row = &mut rows[i];
    row.version = row.version.wrapping_add(1);
    row.cached_in = p as u32;
    let ticket = Ticket {
        block: b,
        version: row.version,
    };
    let q = &mut queues[p];
    q.reclaimable += u64::from(row.reclaimable);
    q.queue(ranking.end(row, links, b)).push(key, ticket);
    if leaves && links[i].is_leaf() {
        push_leaf(
            &mut q.leaves,
            &mut q.young,
            row,
            evict_key,
            ticket,
            ranking.adaptive(),
        );
    }
    q.pushed(rows, links, p, 1);
}

/// Pops the `k` lowest-ranked blocks of a plain core's pool `pool` (its queue of every cached
/// block) onto `out`, then takes each out of the cache index and the prefix index: what
/// `Core::detach_block` does, less the cache-index counts and the counters, which the caller
/// updates once for all `k`; it checked that there are `k`.
#[inline(never)] // a call boundary: its &mut arguments do not alias
pub(super) fn pop_evictable(
    queue: &mut EvictionQueue,
    rows: &mut [BlockRow],
    index: &mut PrefixIndex,
    ranking: Ranking<'_>,
    pool: usize,
    k: u64,
    out: &mut Vec<u32>,
) {
    let first = out.len();
    let popped = with_policy_key!(ranking, |key| queue.pop_valid_into(
        k,
        |t| entry_valid(rows, pool, t),
        |b| key(b as usize, &rows[b as usize]),
        out,
    ));
    assert_eq!(popped, k, "room was checked before evicting");
    let mut table = index.table(0);
    for &b in &out[first..] {
        let row = &mut rows[b as usize];
        debug_assert!(row.is_cached());
        row.cached_in = NOT_CACHED;
        row.reclaimable = false;
        if row.indexed {
            row.indexed = false;
            table.remove(row.hash, b);
        }
    }
}

/// Queues a cached leaf of a pool (its `leaves` and `young`) under its eviction key `key`: in
/// its class's queue, and with the first-seen ones youngest first where eviction takes those
/// (`adaptive`, see [`Ranking::adaptive`]).
#[inline(always)]
pub(super) fn push_leaf(
    leaves: &mut [EvictionQueue; CLASSES],
    young: &mut EvictionQueue,
    row: &BlockRow,
    key: Key,
    ticket: Ticket,
    adaptive: bool,
) {
    leaves[leaf_queue(row)].push(key, ticket);
    if adaptive && leaf_queue(row) == 0 && !row.released {
        young.push(youngest_first(row), ticket);
    }
}

/// The leaf queue of a cached leaf: its class's, a released one the first's (its key ranks it
/// below every other there).
#[inline(always)]
pub(super) fn leaf_queue(row: &BlockRow) -> usize {
    if row.released {
        0
    } else {
        usize::from(row.class)
    }
}

/// A first-seen leaf's key in the youngest-first queue.
#[inline(always)]
pub(super) fn youngest_first(row: &BlockRow) -> Key {
    Key::first(u64::MAX - row.last_access)
}

/// Whether a cache-index entry of `pool` still stands for its block.
pub(super) fn entry_valid(rows: &[BlockRow], pool: usize, t: &Ticket) -> bool {
    let row = &rows[t.block as usize];
    row.cached_in as usize == pool && row.version == t.version
}

/// Whether a leaf-queue entry of `pool` still stands for its block: valid, and a leaf.
pub(super) fn leaf_valid(rows: &[BlockRow], links: &[Link], pool: usize, t: &Ticket) -> bool {
    entry_valid(rows, pool, t) && links[t.block as usize].is_leaf()
}
