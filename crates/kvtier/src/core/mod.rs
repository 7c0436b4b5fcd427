//! `Core`: the block table, sequences, slot pools, prefix index and statistics of one engine.
//!
//! Lifecycle of a block: allocated at level 0 on the device when a sequence first needs it (or
//! shared from the prefix index when its hash is already present), referenced by one or more
//! sequences (refcount), *cached* when the last sequence lets go while its hash is indexed, and
//! freed when evicted (or at once, when it was never indexed). Moves between levels and tiers
//! happen only through a [`crate::Plan`] (two-phase: plan reserves destination slots, commit frees
//! the sources), so a slot is never reused before the copy out of it is done.
//!
//! Cached blocks form prefix trees (`Config::prefix_aware`): each indexed block links to its
//! parent, the block indexed under the hash before its own, and a block is indexed only while
//! its parent is (a block at position 0 is a root). Eviction takes leaves only, so no cached
//! block is ever stranded behind a missing one; anything else that takes a block out of the
//! index (`forget`, a drop) takes its descendants with it.
//!
//! Invariants: every live block with a slot holds exactly one slot of the pool of its
//! (tier, level); per-tier byte counters equal the bytes of the slots in use; a block is in the
//! cache index of its pool exactly while it is cached (refcount 0, unpinned, not in a pending
//! plan, holding a slot), and in the pool's leaf queue too while it is also a leaf; a block is
//! reclaimable (counted per pool) while it is cached and so is every indexed descendant.
//!
//! The state is split by what it is, each part in a module below `Core` that never names it:
//! `blocks` (the block table: rows, prefix-tree links, ids), `ranking` (a block's key under the
//! policy), `cache` (each pool's cached blocks in key order), `frequency` (how often each block
//! hash came back: what adaptive eviction ranks leaves by), and `passes` (the batch passes of an
//! append or a free over those parts). `Core`'s methods are grouped by what they do: pools
//! and bytes (here), block ids (`ids`), the prefix tree (`tree`), the cache index and making
//! room (`eviction`), appends (`append`), sequences and lookups (`sequences`), statistics and
//! pins (`signals`), inspection (`inspect`), the log of index changes (`index_log`); plans are
//! `crate::scheduler`'s.

mod append;
mod blocks;
mod cache;
mod eviction;
mod frequency;
mod ids;
mod index_log;
mod inspect;
mod passes;
mod ranking;
mod sequences;
mod signals;
mod tree;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::config::{Config, Tier};
use crate::error::{Error, Result};
use crate::pool::SlotPool;
use crate::prefix::PrefixIndex;
use crate::stats::{BlockStats, DecayTable};

use self::blocks::Blocks;
use self::cache::PoolCache;
use self::frequency::Frequency;
use self::ranking::{PoolMap, Ranking};

pub(crate) use self::cache::Cached;
pub use self::index_log::IndexChange;
pub(crate) use self::ranking::End;
pub use crate::types::{Key, Loc, NO_SLOT};

/// Hashes an id by one multiply: a sequence id, or a block hash (a trace's may be a small
/// integer). Sequence ids are handed out in order, and the low bits of `id * odd` run through
/// every value as the id does, so consecutive ids fill distinct buckets; SipHash would cost
/// more than the lookup it serves.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Live sequences by id (unordered: see [`Core::sequence_ids`] for id order).
pub(crate) type Sequences = HashMap<u32, Sequence, BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone, Default)]
pub(crate) struct Sequence {
    pub(crate) blocks: Vec<u32>,
    pub(crate) tokens: u64,
    /// Hash of the last full block (before the first, the namespace seed, or the salted seed of
    /// a salted sequence).
    chain: u64,
    /// Token ids of the trailing partial block, hashed when it fills.
    partial: Vec<u32>,
    /// Tokens were appended without ids (`extend`): the hash chain is broken, so no later block
    /// of this sequence is hashed or shared.
    opaque: bool,
    /// Its conversation has ended (`Core::release`): the blocks it is the last to let go of
    /// are released then.
    released: bool,
}

/// Event counters since the core was created.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub allocated: u64,
    pub released: u64,
    pub shared_hits: u64,
    pub evictions: u64,
    pub demotions: u64,
    pub promotions: u64,
    pub offloads: u64,
    pub fetches: u64,
    pub drops: u64,
    pub backups: u64,
    pub noop_promotions: u64,
    pub deferred_moves: u64,
    pub bytes_moved: u64,
    pub plans: u64,
    pub aborts: u64,
    /// Moves dropped at commit because their block was pinned or shared again meanwhile.
    pub cancelled_moves: u64,
}

/// What an append did: the blocks added to the sequence, and which of them were already
/// cached (shared, nothing to write) rather than new.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Appended {
    pub blocks: Vec<u32>,
    pub shared: Vec<bool>,
}

/// A fork: the child sequence, and the partial block the engine must copy (parent → child).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forked {
    pub child: u32,
    pub copy: Option<(u32, u32)>,
}

/// Occupancy of one pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolUsage {
    pub tier: Tier,
    pub level: u8,
    pub used_slots: u32,
    pub capacity_slots: u32,
    pub bytes: u64,
}

pub struct Core {
    pub(crate) cfg: Config,
    pub(crate) pools: Vec<SlotPool>,
    pub(crate) tier_bytes: Vec<u64>,
    pub(crate) blocks: Blocks,
    /// Statistics by block id; written only through `stats_mut`, which sets `stats_written`.
    stats: Vec<BlockStats>,
    /// Some statistic was ever written: until then every row is the default, and a reused
    /// block id needs no reset (a trace replay under `lru` never writes one).
    stats_written: bool,
    pub(crate) decay: DecayTable,
    pub(crate) index: PrefixIndex,
    pub(crate) seqs: Sequences,
    /// Block lists of freed sequences, emptied, for new ones: a request-per-sequence workload
    /// then allocates none. Never more than the peak number of live sequences.
    spare_block_lists: Vec<Vec<u32>>,
    /// Level-0 device blocks evicted to make room, each still holding its id and slot for the
    /// new block about to take them (see `ensure_device_room`); empty between calls.
    recycled: Vec<u32>,
    /// Blocks a freed sequence left unreferenced and unindexed, released after its pass over
    /// its blocks; empty between calls.
    orphans: Vec<u32>,
    /// The ids of an append's new blocks, in the order they are taken; empty between calls.
    new_ids: Vec<u32>,
    next_seq: u32,
    pub(crate) step: u32,
    clock: u64,
    /// The cache index of each pool, by pool index.
    caches: Vec<PoolCache>,
    /// How often each block hash came back (`importance`, prefix-aware: see `frequency`).
    freq: Frequency,
    /// Position of each tier in the config (`usize::MAX` if absent), by `Tier as usize`.
    tier_at: [usize; 4],
    pub(crate) pending: Option<crate::Plan>,
    pub(crate) next_plan: u64,
    /// `Core::config_may_idle`, derived once: a replay plans after every request.
    pub(crate) plans_may_idle: bool,
    pub(crate) counters: Counters,
    /// Per-block scratch for the scheduler (all `u32::MAX` between plans).
    pub(crate) scratch: Vec<u32>,
    /// Changes to the prefix index not yet taken (`None`: not logged; see `index_log`).
    index_log: Option<Vec<IndexChange>>,
}

impl Core {
    pub fn new(cfg: Config) -> Result<Core> {
        cfg.validate()?;
        let levels = cfg.num_levels();
        let mut pools = Vec::with_capacity(cfg.tiers.len() * levels);
        for t in &cfg.tiers {
            for (level, &bytes) in cfg.level_bytes.iter().enumerate() {
                let level = level as u8;
                let explicit = cfg
                    .pool_slots
                    .iter()
                    .find(|p| p.0 == t.tier && p.1 == level);
                let capacity = match (explicit, t.budget_bytes) {
                    (Some(&(_, _, slots)), _) => slots,
                    (None, _) if bytes == 0 => 0,
                    // Sized so that a plan whose result fits the budget always finds a slot.
                    (None, Some(budget)) => (budget / bytes).min(u64::from(NO_SLOT - 1)) as u32,
                    (None, None) => NO_SLOT - 1,
                };
                pools.push(SlotPool::new(t.tier, level, capacity));
            }
        }
        // A bounded device holds about this many blocks: room for them up front spares a
        // replay the copies of growing (capped: a huge budget may never fill).
        let expected_blocks = cfg.tiers[0]
            .budget_bytes
            .map_or(0, |b| b / cfg.level_bytes[0].max(1))
            .min(1 << 20) as usize;
        let mut tier_at = [usize::MAX; 4];
        for (pos, t) in cfg.tiers.iter().enumerate() {
            tier_at[t.tier as usize] = pos;
        }
        Ok(Core {
            tier_at,
            caches: pools
                .iter()
                .map(|p| PoolCache::new(cfg.level_bytes[usize::from(p.level())]))
                .collect(),
            decay: DecayTable::new(cfg.decay),
            freq: Frequency::default(),
            tier_bytes: vec![0; cfg.tiers.len()],
            pools,
            blocks: Blocks::with_capacity(expected_blocks),
            stats: Vec::with_capacity(expected_blocks),
            stats_written: false,
            index: PrefixIndex::with_capacity(expected_blocks),
            seqs: Sequences::default(),
            spare_block_lists: Vec::new(),
            recycled: Vec::new(),
            orphans: Vec::new(),
            new_ids: Vec::new(),
            next_seq: 0,
            step: 0,
            clock: 0,
            pending: None,
            next_plan: 1,
            plans_may_idle: Core::config_may_idle(&cfg),
            counters: Counters::default(),
            scratch: Vec::new(),
            index_log: None,
            cfg,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn step_clock(&self) -> u32 {
        self.step
    }

    #[inline]
    pub(crate) fn tier_pos(&self, tier: Tier) -> usize {
        let pos = self.tier_at[tier as usize];
        debug_assert!(pos != usize::MAX, "tier validated against the config");
        pos
    }

    #[inline]
    pub(crate) fn pool_index(&self, tier: Tier, level: u8) -> usize {
        self.tier_pos(tier) * self.cfg.num_levels() + usize::from(level)
    }

    pub(crate) fn level_bytes(&self, level: u8) -> u64 {
        self.cfg.level_bytes[usize::from(level)]
    }

    pub(crate) fn budget(&self, tier_pos: usize) -> Option<u64> {
        self.cfg.tiers[tier_pos].budget_bytes
    }

    /// Takes a slot at (tier, level) and counts its bytes; `None` if the pool is full.
    #[inline(always)]
    pub(crate) fn take_slot(&mut self, tier: Tier, level: u8) -> Option<Loc> {
        let p = self.pool_index(tier, level);
        let slot = self.pools[p].alloc_one()?;
        let t = self.tier_pos(tier);
        self.tier_bytes[t] += self.level_bytes(level);
        Some(Loc { tier, level, slot })
    }

    #[inline(always)]
    pub(crate) fn give_slot(&mut self, loc: Loc) {
        if loc.slot == NO_SLOT {
            return;
        }
        let p = self.pool_index(loc.tier, loc.level);
        self.pools[p].release(loc.slot);
        let t = self.tier_pos(loc.tier);
        self.tier_bytes[t] -= self.level_bytes(loc.level);
    }

    pub fn usage(&self) -> Vec<PoolUsage> {
        self.pools
            .iter()
            .enumerate()
            .map(|(i, pool)| {
                let tier = self.cfg.tiers[i / self.cfg.num_levels()].tier;
                let level = (i % self.cfg.num_levels()) as u8;
                PoolUsage {
                    tier,
                    level,
                    used_slots: pool.used(),
                    capacity_slots: pool.capacity(),
                    bytes: u64::from(pool.used()) * self.level_bytes(level),
                }
            })
            .collect()
    }

    /// Bytes in use per tier, in config order.
    pub fn tier_bytes(&self) -> &[u64] {
        &self.tier_bytes
    }

    pub fn set_budget(&mut self, tier: Tier, budget: Option<u64>) -> Result<()> {
        let t = self
            .cfg
            .tier_index(tier)
            .ok_or_else(|| Error::InvalidArgument {
                what: "tier",
                reason: format!("{tier} is not configured"),
            })?;
        self.cfg.tiers[t].budget_bytes = budget;
        // Pools sized from the budget grow with it (they never shrink below slots handed out).
        let levels = self.cfg.num_levels();
        for level in 0..levels {
            let explicit = self
                .cfg
                .pool_slots
                .iter()
                .any(|p| p.0 == tier && usize::from(p.1) == level);
            let bytes = self.cfg.level_bytes[level];
            if !explicit && bytes > 0 {
                let slots = budget.map_or(NO_SLOT - 1, |b| {
                    (b / bytes).min(u64::from(NO_SLOT - 1)) as u32
                });
                self.pools[t * levels + level].grow_to(slots);
            }
        }
        Ok(())
    }

    #[inline(always)]
    fn pool_map(&self) -> PoolMap {
        PoolMap {
            tier_at: self.tier_at,
            levels: self.cfg.num_levels(),
        }
    }

    pub(crate) fn stats_mut(&mut self) -> &mut [BlockStats] {
        self.stats_written = true;
        &mut self.stats
    }

    /// What ranking keys are computed from besides a block's row.
    #[inline(always)]
    fn ranking(&self) -> Ranking<'_> {
        Ranking {
            cfg: &self.cfg,
            decay: &self.decay,
            stats: &self.stats,
        }
    }

    /// The policy's ranking key of a block. Lower is demoted, offloaded, evicted first.
    #[inline(always)]
    pub(crate) fn key(&self, b: usize) -> Key {
        self.ranking().key(b, &self.blocks.rows[b])
    }

    /// What eviction ranks a block by now, as `peek_cached` ranks a leaf: its eviction key
    /// (see [`Ranking::evict_key`]), or where eviction adapts, `Frequency::rank`.
    #[inline(always)]
    pub(crate) fn evict_key(&self, b: usize) -> Key {
        let (ranking, row) = (self.ranking(), &self.blocks.rows[b]);
        if ranking.adaptive() {
            self.freq.rank(row, self.clock)
        } else {
            ranking.evict_key(b, row)
        }
    }
}
