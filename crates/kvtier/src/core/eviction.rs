//! The cache index as `Core` keeps it (a block enters its pool's queues when it becomes cached
//! and leaves them on any change that ends that), the lowest-ranked cached block of a pool, and
//! making room on the device for new blocks by evicting cached ones.

use crate::config::Tier;
use crate::error::{Error, Result};
use crate::evict::Ticket;
use crate::types::Key;

use super::blocks::NOT_CACHED;
use super::cache::{
    enqueue_if_cached, entry_valid, leaf_valid, pop_evictable, settle_reclaimable, youngest_first,
    Cached, PoolCache,
};
use super::ranking::{End, Ranking};
use super::Core;

impl Core {
    #[inline]
    pub(crate) fn is_cached(&self, b: usize) -> bool {
        self.blocks.rows[b].is_cached()
    }

    /// Re-derives whether `b` is cached (and where, and whether a leaf and reclaimable) after
    /// any change to its refcount, pins, moving flag, location, children or ranking key; keeps
    /// the per-pool counts and queues in step.
    #[inline]
    pub(crate) fn refresh_evictable(&mut self, b: u32) {
        self.leave_cache(b);
        self.enter_cache_if_cached(b);
        self.settle_block(b);
    }

    /// Brings `b`'s `reclaimable` flag (and its ancestors') up to date.
    #[inline(always)]
    pub(super) fn settle_block(&mut self, b: u32) {
        settle_reclaimable(
            &mut self.blocks.rows,
            &mut self.blocks.links,
            &mut self.caches,
            b,
        );
    }

    /// Enters a block that is in no cache index into its pool's, if it is cached now.
    #[inline(always)]
    fn enter_cache_if_cached(&mut self, b: u32) {
        let pools = self.pool_map();
        let leaves = self.prefix_aware();
        let Core {
            cfg,
            decay,
            stats,
            blocks,
            caches,
            ..
        } = self;
        let ranking = Ranking { cfg, decay, stats };
        enqueue_if_cached(
            &mut blocks.rows,
            &blocks.links,
            caches,
            ranking,
            pools,
            leaves,
            b,
        );
    }

    /// Takes a block out of the cache index (its entries go stale); the caller settles it.
    #[inline]
    pub(super) fn leave_cache(&mut self, b: u32) {
        self.blocks.rows[b as usize].leave_cache(&mut self.caches);
    }

    /// `refresh_evictable` for a change that can only make a block not cached.
    pub(crate) fn refresh_evictable_if_indexed(&mut self, b: u32) {
        if self.blocks.rows[b as usize].cached_in != NOT_CACHED {
            self.refresh_evictable(b);
        }
    }

    /// The queue eviction takes from: the leaves (prefix-aware), else every cached block.
    #[inline(always)]
    pub(crate) fn victims(&self) -> Cached {
        if self.prefix_aware() {
            Cached::Leaves
        } else {
            Cached::Any
        }
    }

    /// The lowest-ranked block of a pool's queue `which` (for `Any`, of the blocks that are no
    /// chain's end: a plain core's every cached block), left in place. For `Leaves`, what
    /// eviction takes: the lowest front of the class queues, ranked by `Frequency::rank` under
    /// `importance` (the young-first rule may name another block, under the same rank).
    #[inline]
    pub(crate) fn peek_cached(&mut self, pool: usize, which: Cached) -> Option<(Key, u32)> {
        let ranking = Ranking {
            cfg: &self.cfg,
            decay: &self.decay,
            stats: &self.stats,
        }; // not self.ranking(): the queue below is borrowed mutably
        let (rows, links) = (&self.blocks.rows, &self.blocks.links);
        if let Cached::Any | Cached::Ranked(_) = which {
            let end = match which {
                Cached::Ranked(end) => end,
                _ => End::None,
            };
            let top = self.caches[pool].queue(end).peek_valid(
                |t| entry_valid(rows, pool, t),
                |b| ranking.key(b as usize, &rows[b as usize]),
            );
            return top.map(|e| (e.key, e.ticket.block));
        }
        let valid = |t: &Ticket| leaf_valid(rows, links, pool, t);
        let cache = &mut self.caches[pool];
        let adaptive = ranking.adaptive();
        let (freq, now) = (&self.freq, self.clock);
        let mut lowest: Option<(Key, u32)> = None;
        for queue in cache.leaves.iter_mut().filter(|q| q.len() > 0) {
            let key_of = |b: u32| ranking.evict_key(b as usize, &rows[b as usize]);
            if let Some(e) = queue.peek_valid(valid, key_of) {
                let b = e.ticket.block;
                let key = if adaptive {
                    freq.rank(&rows[b as usize], now)
                } else {
                    e.key
                };
                if lowest.is_none_or(|l| (key, b) < l) {
                    lowest = Some((key, b));
                }
            }
        }
        let (key, b) = lowest?;
        if adaptive && freq.young_first(&rows[b as usize], now) {
            let youngest = |b: u32| youngest_first(&rows[b as usize]);
            if let Some(e) = cache.young.peek_valid(valid, youngest) {
                return Some((key, e.ticket.block));
            }
        }
        Some((key, b))
    }

    /// Takes the lowest-ranked entry of a pool's cached blocks out of its queue, the chains'
    /// ends after the others (the block stays cached: the caller puts the entry back).
    pub(crate) fn pop_cached(&mut self, pool: usize) -> Option<(Key, Ticket)> {
        let ranking = Ranking {
            cfg: &self.cfg,
            decay: &self.decay,
            stats: &self.stats,
        };
        let rows = &self.blocks.rows;
        let key_of = |b: u32| ranking.key(b as usize, &rows[b as usize]);
        let cache = &mut self.caches[pool];
        let t = cache
            .ranked
            .iter_mut()
            .find_map(|queue| queue.pop_valid(|t| entry_valid(rows, pool, t), key_of))?;
        Some((key_of(t.block), t))
    }

    /// Puts an entry taken by [`Core::pop_cached`] back, if it still stands for its block.
    pub(crate) fn restore_cached(&mut self, pool: usize, key: Key, ticket: Ticket) {
        let row = &self.blocks.rows[ticket.block as usize];
        if entry_valid(&self.blocks.rows, pool, &ticket) {
            let end = self.ranking().end(row, &self.blocks.links, ticket.block);
            self.caches[pool].queue(end).push(key, ticket);
        }
    }

    /// The lowest-ranked block of queue `which` among `pools`; for `Any`, a chain's end only
    /// where none of the pools holds a cached block that is not one, and a sink only where
    /// none holds a leaf either (see [`End`]).
    #[inline]
    pub(crate) fn lowest_cached(
        &mut self,
        pools: impl IntoIterator<Item = usize> + Clone,
        which: Cached,
    ) -> Option<(Key, u32)> {
        match which {
            Cached::Any => End::ALL
                .into_iter()
                .find_map(|end| self.lowest_in(pools.clone(), Cached::Ranked(end))),
            _ => self.lowest_in(pools, which),
        }
    }

    /// The lowest-ranked block of queue `which` among `pools`.
    #[inline]
    fn lowest_in(
        &mut self,
        pools: impl IntoIterator<Item = usize>,
        which: Cached,
    ) -> Option<(Key, u32)> {
        let mut best: Option<(Key, u32)> = None;
        for p in pools {
            if let Some(c) = self.peek_cached(p, which) {
                if best.is_none_or(|b| c < b) {
                    best = Some(c);
                }
            }
        }
        best
    }

    /// The lowest-ranked evictable block among `pools` (a leaf, when prefix-aware).
    #[inline]
    pub(crate) fn lowest_evictable(
        &mut self,
        pools: impl IntoIterator<Item = usize> + Clone,
    ) -> Option<(Key, u32)> {
        let which = self.victims();
        self.lowest_cached(pools, which)
    }

    /// Makes room on the device for `n` new level-0 blocks, evicting cached blocks when the
    /// config allows; checks first, so on failure nothing was evicted. Blocks evicted from the
    /// level-0 pool are left `recycled` for the new blocks: the caller allocates with
    /// `new_device_block`, then calls `release_recycled`.
    pub(super) fn ensure_device_room(&mut self, n: u64) -> Result<()> {
        debug_assert!(
            self.recycled.is_empty(),
            "recycled blocks left from the last call"
        );
        if n == 0 {
            return Ok(()); // nothing new (a request wholly shared): fits even over a budget
        }
        let bytes = self.cfg.level_bytes[0];
        let need = n * bytes;
        let budget = self.budget(0).unwrap_or(u64::MAX);
        let pool0 = self.pool_index(Tier::Device, 0);
        let fits = |c: &Core| {
            u128::from(c.tier_bytes[0]) + u128::from(need) <= u128::from(budget)
                && n <= u64::from(c.pools[pool0].free_count())
        };
        if fits(self) {
            return Ok(());
        }
        // Whether evicting every reclaimable device block would make room, decided before
        // evicting anything: a failed append evicts nothing. Evicting level-0 blocks frees
        // level-0 slots; evicting any block frees bytes.
        let levels = self.cfg.num_levels();
        let reclaimable: u64 = self.caches[..levels]
            .iter()
            .map(PoolCache::reclaimable_bytes)
            .sum();
        let bytes_ok = u128::from(self.tier_bytes[0]) + u128::from(need)
            <= u128::from(budget) + u128::from(reclaimable);
        let free_slots = u64::from(self.pools[pool0].free_count());
        let slots_ok = n <= free_slots + self.caches[pool0].reclaimable;
        let evict = self.cfg.evict_on_full;
        if !evict || !bytes_ok || !slots_ok {
            let free = budget.saturating_sub(self.tier_bytes[0]);
            // Name the limit that stops it: the byte budget, else the level-0 pool's slots (a
            // byte error with enough bytes free would contradict itself).
            let bytes_short = if evict { !bytes_ok } else { free < need };
            return Err(if bytes_short {
                Error::OutOfCapacity {
                    tier: Tier::Device,
                    level: 0,
                    requested: need,
                    free,
                    budget,
                }
            } else {
                Error::OutOfSlots {
                    tier: Tier::Device,
                    level: 0,
                    requested: n,
                    free: free_slots,
                }
            });
        }
        if self.prefix_aware() {
            // Leaves only: level-0 slots first (each such eviction frees bytes too), then bytes.
            while n > u64::from(self.pools[pool0].free_count()) {
                let freed = self.evict_level0_slot().is_some();
                debug_assert!(freed, "room was checked before evicting");
                if !freed {
                    break;
                }
            }
            while !fits(self) {
                let Some((_, b)) = self.lowest_evictable(0..levels) else {
                    break;
                };
                self.evict_now(b);
            }
            debug_assert!(fits(self), "room was checked before evicting");
            return Ok(());
        }
        // It does not fit yet (checked above): each round evicts, then checks again.
        loop {
            let over = self.tier_bytes[0]
                .saturating_add(need)
                .saturating_sub(budget);
            if over == 0 || levels == 1 {
                // Every eviction from the level-0 pool frees one slot and one level-0 block's
                // bytes: evict the shortfall in one sweep, for the new blocks to reuse.
                let short_slots = n.saturating_sub(u64::from(self.pools[pool0].free_count()));
                self.evict_for_reuse(short_slots.max(over.div_ceil(bytes)));
                return Ok(());
            }
            let (_, b) = self
                .lowest_evictable(0..levels)
                .expect("room was checked before evicting");
            self.evict_now(b);
            if fits(self) {
                return Ok(());
            }
        }
    }

    /// The id of a new level-0 device block, holding its slot: the last block evicted for room
    /// if any (the id and slot the free lists would give back first, without the round trip),
    /// else a fresh one (room was ensured).
    #[inline(always)]
    pub(super) fn new_device_id(&mut self) -> u32 {
        match self.recycled.pop() {
            Some(b) => b, // its row still holds the slot
            None => {
                let loc = self
                    .take_slot(Tier::Device, 0)
                    .expect("room ensured before allocating");
                let b = self.new_block_id();
                self.blocks.rows[b as usize].loc = loc;
                b
            }
        }
    }

    /// Evicts the `k` lowest-ranked cached blocks of the (device, level 0) pool of a plain
    /// core for new blocks to reuse their ids and slots (`recycled`); the caller checked there
    /// are `k`.
    fn evict_for_reuse(&mut self, k: u64) {
        debug_assert!(!self.prefix_aware());
        let pool = self.pool_index(Tier::Device, 0);
        let first = self.recycled.len();
        let Core {
            cfg,
            decay,
            stats,
            blocks,
            caches,
            index,
            recycled,
            ..
        } = self;
        let ranking = Ranking { cfg, decay, stats };
        let cache = &mut caches[pool];
        pop_evictable(
            cache.queue(End::None),
            &mut blocks.rows,
            index,
            ranking,
            pool,
            k,
            recycled,
        );
        cache.count -= k;
        cache.reclaimable -= k; // a plain core's cached blocks are all reclaimable
        self.counters.evictions += k;
        self.counters.released += k;
        if self.index_log_on() {
            for i in first..self.recycled.len() {
                let hash = self.blocks.rows[self.recycled[i] as usize].hash;
                self.log_left(hash); // cached, so it was indexed
            }
        }
        if self.cfg.tiers.len() > 1 {
            for i in first..self.recycled.len() {
                self.release_copy(self.recycled[i]);
            }
        }
    }

    /// Frees the recycled blocks no new block took, as evicting them would have, in the
    /// order they were evicted: ids and slots are handed out as if each went through the
    /// free lists.
    pub(super) fn release_recycled(&mut self) {
        let mut recycled = std::mem::take(&mut self.recycled);
        for &b in &recycled {
            self.free_id_and_slot(b);
        }
        recycled.clear();
        self.recycled = recycled;
    }

    /// Removes a cached block from the cache entirely (no copy needed: nobody reads it). A
    /// prefix-aware core evicts leaves only.
    pub(crate) fn evict_now(&mut self, b: u32) {
        debug_assert!(self.is_cached(b as usize));
        debug_assert!(!self.prefix_aware() || self.blocks.links[b as usize].is_leaf());
        self.count_eviction(b);
        self.release_block(b);
    }

    /// Counts the eviction of `b`, and the age it goes at: how long the cache keeps a block
    /// unread, what `Frequency` weighs the chance of a reuse over.
    pub(crate) fn count_eviction(&mut self, b: u32) {
        self.counters.evictions += 1;
        let idle = self
            .clock
            .saturating_sub(self.blocks.rows[b as usize].last_access);
        self.freq.evicted(idle);
    }

    /// Evicts `n` cached blocks of the device's level-0 pool as making room for new blocks
    /// does (one slot at a time: [`Core::evict_level0_slot`]), none of `protected` (pinned
    /// meanwhile), and returns their hashes. All or nothing: None, with nothing evicted, when
    /// fewer than `n` could go. For a cache that asks its policy for victims, as vLLM's CPU
    /// offloading asks its `CachePolicy`.
    pub fn evict_cached(&mut self, n: u64, protected: &[u32]) -> Result<Option<Vec<u64>>> {
        self.pin(protected)?;
        let pool = self.pool_index(Tier::Device, 0);
        let evicted = (self.caches[pool].reclaimable >= n).then(|| {
            (0..n)
                .map(|_| {
                    self.evict_level0_slot()
                        .expect("reclaimable blocks were counted")
                })
                .collect()
        });
        self.unpin(protected)?;
        Ok(evicted)
    }

    /// Evicts cached blocks until one level-0 slot of the device is free: its lowest-ranked
    /// leaf, else (its reclaimable blocks all have children elsewhere) the lowest-ranked of
    /// them, leaves of its subtree first. Returns the evicted block's hash; None if the pool
    /// holds nothing reclaimable.
    fn evict_level0_slot(&mut self) -> Option<u64> {
        let pool = self.pool_index(Tier::Device, 0);
        let which = self.victims();
        if let Some((_, b)) = self.peek_cached(pool, which) {
            let hash = self.blocks.rows[b as usize].hash;
            self.evict_now(b);
            return Some(hash);
        }
        if self.caches[pool].reclaimable == 0 {
            return None;
        }
        // The lowest-ranked reclaimable block: entries that are not are set aside and put back.
        let mut aside = Vec::new();
        let found = loop {
            let Some((key, ticket)) = self.pop_cached(pool) else {
                break None;
            };
            aside.push((key, ticket));
            if self.blocks.rows[ticket.block as usize].reclaimable {
                break Some(ticket.block);
            }
        };
        for (key, ticket) in aside {
            self.restore_cached(pool, key, ticket);
        }
        // Every descendant of a reclaimable block is cached: the first leaf down goes.
        let mut leaf = found?;
        while !self.blocks.links[leaf as usize].is_leaf() {
            leaf = self.blocks.links[leaf as usize].first_child;
        }
        let hash = self.blocks.rows[leaf as usize].hash;
        self.evict_now(leaf);
        Some(hash)
    }
}
