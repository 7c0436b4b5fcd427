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

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::config::{Config, PolicyKind, Tier};
use crate::error::{Error, Result};
use crate::evict::{EvictionQueue, Ticket};
use crate::pool::SlotPool;
use crate::prefix::{chain_hash, PrefixIndex};
use crate::stats::{BlockStats, DecayTable, KNOWN_ATTENTION, KNOWN_LEARNED, KNOWN_MAGNITUDE};

pub const NO_SLOT: u32 = u32::MAX;

/// Where a block's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub tier: Tier,
    pub level: u8,
    pub slot: u32,
}

/// Ranking key of a block under the policy: lower goes first. Three components compared in
/// order; floats are stored as order-preserving integers so heap comparisons are integer ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key(u64, u64, u64);

/// Maps an f64 onto a u64 with the same order (total order, -inf lowest): a negative one has
/// every bit flipped, any other its sign bit set (by one mask, not a branch on the sign).
fn ordered(x: f64) -> u64 {
    let bits = x.to_bits();
    let negative = ((bits as i64) >> 63) as u64;
    bits ^ (negative | (1 << 63))
}

impl Key {
    pub fn new(primary: f64, secondary: f64, recency: u64) -> Key {
        Key(ordered(primary), ordered(secondary), recency)
    }

    /// The primary component (the policy's score) as a float.
    pub fn primary(self) -> f64 {
        let bits = if self.0 >> 63 == 1 {
            self.0 & !(1 << 63)
        } else {
            !self.0
        };
        f64::from_bits(bits)
    }
}

/// What a block's ranking key is computed from besides its row, borrowed apart from the rows
/// and the eviction queues, so that a loop can hold all three at once (and a queue can ask for
/// keys while it changes).
#[derive(Clone, Copy)]
pub(crate) struct Ranking<'a> {
    cfg: &'a Config,
    decay: &'a DecayTable,
    stats: &'a [BlockStats],
}

impl Ranking<'_> {
    /// The key of block `b`, whose row is `row`.
    #[inline(always)]
    pub(crate) fn key(&self, b: usize, row: &BlockRow) -> Key {
        self.key_as(self.cfg.policy, b, row)
    }

    /// [`Ranking::key`] under `policy`, which is the core's: a loop that names it as a
    /// constant (see [`with_policy_key`]) computes keys without a `match` per block.
    #[inline(always)]
    fn key_as(&self, policy: PolicyKind, b: usize, row: &BlockRow) -> Key {
        debug_assert_eq!(policy, self.cfg.policy);
        let recency = row.last_access;
        let freq = || self.decay.log_count(row.reads, row.reads_step);
        let stats = || &self.stats[b]; // only where the policy ranks by them
        match policy {
            PolicyKind::Lru => Key::new(0.0, 0.0, recency),
            PolicyKind::Lfu => Key::new(freq(), 0.0, recency),
            PolicyKind::H2o => Key::new(f64::from(stats().attn_sum), 0.0, recency),
            PolicyKind::Scissorhands => {
                let s = stats();
                let mask = u32::MAX >> (32 - self.cfg.scissorhands_window);
                let persistence = (s.attn_history & mask).count_ones();
                Key::new(f64::from(persistence), f64::from(s.attn_ema), recency)
            }
            PolicyKind::Importance => Key::new(f64::from(stats().importance), freq(), recency),
        }
    }

    /// The key eviction ranks a cached leaf by (prefix-aware cores): [`Ranking::key`], but
    /// under `importance`, reuse first, then importance. Eviction decides whether a block will
    /// be loaded again, which its decayed accesses tell (its write counting as one, so that a
    /// block saved now outranks one read once long ago); how much attention needs its
    /// precision, which importance tells, decides its level (`key`: demotion and offload
    /// order).
    #[inline(always)]
    pub(crate) fn evict_key(&self, b: usize, row: &BlockRow) -> Key {
        match self.cfg.policy {
            PolicyKind::Importance => Key::new(
                // An unread block's count is 0 as of the step that wrote it.
                self.decay.log_count(row.reads.max(1.0), row.reads_step),
                f64::from(self.stats[b].importance),
                row.last_access,
            ),
            _ => self.key(b, row),
        }
    }
}

/// Evaluates `$body` with `$key` bound to the key function of `$ranking`'s policy
/// (`Fn(usize, &BlockRow) -> Key`), the policy a constant in each copy of `$body`: a loop over
/// many blocks matches on the policy once, not once per block.
macro_rules! with_policy_key {
    ($ranking:expr, |$key:ident| $body:expr) => {{
        let ranking: Ranking<'_> = $ranking;
        macro_rules! arm {
            ($policy:expr) => {{
                let $key = |b: usize, row: &BlockRow| ranking.key_as($policy, b, row);
                $body
            }};
        }
        match ranking.cfg.policy {
            PolicyKind::Lru => arm!(PolicyKind::Lru),
            PolicyKind::Lfu => arm!(PolicyKind::Lfu),
            PolicyKind::H2o => arm!(PolicyKind::H2o),
            PolicyKind::Scissorhands => arm!(PolicyKind::Scissorhands),
            PolicyKind::Importance => arm!(PolicyKind::Importance),
        }
    }};
}

/// The pool of a (tier, level): its index in `Core::pools` and `Core::caches`, copied out
/// of the core so that a loop over blocks computes it from registers.
#[derive(Clone, Copy)]
pub(crate) struct PoolMap {
    /// Position of each tier in the config (`usize::MAX` if absent), by `Tier as usize`.
    tier_at: [usize; 4],
    levels: usize,
}

impl PoolMap {
    #[inline(always)]
    fn of(self, tier: Tier, level: u8) -> usize {
        let pos = self.tier_at[tier as usize];
        debug_assert!(pos != usize::MAX, "tier validated against the config");
        pos * self.levels + usize::from(level)
    }
}

/// Hashes a sequence id by one multiply. Ids are handed out in order, and the low bits of
/// `id * odd` run through every value as the id does, so consecutive ids fill distinct
/// buckets; SipHash would cost more than the lookup it serves.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SeqIdHasher(u64);

impl Hasher for SeqIdHasher {
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
}

/// Live sequences by id (unordered: see [`Core::sequence_ids`] for id order).
pub(crate) type Sequences = HashMap<u32, Sequence, BuildHasherDefault<SeqIdHasher>>;

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

/// A block `append_tokens` is about to add: its hash and the hash before it (a full block),
/// the indexed block it shares, and its tokens.
type PlannedBlock = (Option<(u64, u64)>, Option<u32>, usize);

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

/// The hot state of one block: everything the per-request paths touch, in one cache line (the
/// alignment keeps a row from straddling two: an allocator's 16-byte alignment would).
#[derive(Debug, Clone, Copy)]
#[repr(align(64))]
pub(crate) struct BlockRow {
    pub(crate) loc: Loc,
    pub(crate) refcount: u32,
    pub(crate) pins: u32,
    /// Cache-index entry version; older entries are stale.
    pub(crate) version: u32,
    /// Pool whose cache index counts this block, or `NOT_CACHED`.
    pub(crate) cached_in: u32,
    pub(crate) position: u32,
    pub(crate) fill: u32,
    pub(crate) hash: u64,
    /// Decayed read count as of `reads_step`.
    pub(crate) reads: f32,
    pub(crate) reads_step: u32,
    /// Access clock of the last read (recency).
    pub(crate) last_access: u64,
    pub(crate) live: bool,
    pub(crate) moving: bool,
    pub(crate) indexed: bool,
    /// Cached, and so is every indexed descendant: evicting leaf after leaf can free it. Counted
    /// in the pool of `cached_in`.
    pub(crate) reclaimable: bool,
}

pub(crate) const NOT_CACHED: u32 = u32::MAX;
/// No block: a root's parent, the end of a list of children.
pub(crate) const NO_BLOCK: u32 = u32::MAX;

impl BlockRow {
    /// Unreferenced, unpinned, not moving and holding a slot: cached, ready to be demoted,
    /// offloaded or (a leaf) evicted.
    #[inline(always)]
    fn is_cached(&self) -> bool {
        self.live
            && self.refcount == 0
            && self.pins == 0
            && !self.moving
            && self.loc.slot != NO_SLOT
    }

    /// The row of a new block at the location this row holds, referenced once and touched at
    /// access clock `tick`; its content fields (position, fill, hash, indexed) from `new`.
    #[inline(always)]
    fn renew(&mut self, new: BlockRow, step: u32, tick: u64) {
        *self = BlockRow {
            refcount: 1,
            loc: self.loc,
            // The version survives reuse so that stale eviction-index entries stay stale.
            version: self.version,
            reads_step: step,
            last_access: tick,
            live: true,
            ..new
        };
    }

    /// Takes the block out of its pool's cache index (`queues`), if it is in one: its entries
    /// go stale. Its `reclaimable` flag stays for the caller to settle.
    #[inline(always)]
    fn leave_cache(&mut self, queues: &mut [PoolCache]) {
        if self.cached_in != NOT_CACHED {
            let q = &mut queues[self.cached_in as usize];
            q.count -= 1;
            q.reclaimable -= u64::from(self.reclaimable);
            self.cached_in = NOT_CACHED;
        }
    }

    /// One read at step `step` and access-clock value `tick`: the recency, and the decayed read
    /// count where the policy ranks by it (`counts`: the decay table).
    #[inline(always)]
    fn read(&mut self, counts: Option<&DecayTable>, step: u32, tick: u64) {
        if let Some(decay) = counts {
            self.reads = self.reads * decay.pow(step - self.reads_step) + 1.0;
            self.reads_step = step;
        }
        self.last_access = tick;
    }
}

impl Default for BlockRow {
    fn default() -> Self {
        BlockRow {
            loc: Loc {
                tier: Tier::Device,
                level: 0,
                slot: NO_SLOT,
            },
            refcount: 0,
            pins: 0,
            version: 0,
            cached_in: NOT_CACHED,
            position: 0,
            fill: 0,
            hash: 0,
            reads: 0.0,
            reads_step: 0,
            last_access: 0,
            live: false,
            moving: false,
            indexed: false,
            reclaimable: false,
        }
    }
}

/// A block's place in the prefix tree (prefix-aware cores; all `NO_BLOCK` otherwise): its
/// parent, its indexed children as a doubly linked list of siblings, and how many of those
/// children are not reclaimable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Link {
    pub(crate) parent: u32,
    pub(crate) first_child: u32,
    next: u32,
    prev: u32,
    blockers: u32,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            parent: NO_BLOCK,
            first_child: NO_BLOCK,
            next: NO_BLOCK,
            prev: NO_BLOCK,
            blockers: 0,
        }
    }
}

impl Link {
    #[inline(always)]
    pub(crate) fn is_leaf(&self) -> bool {
        self.first_child == NO_BLOCK
    }
}

/// Links indexed block `b` (whose row is `rows[b]`; in no parent's list of children) under
/// `parent` (`NO_BLOCK`: a root), with whatever children it has. The caller settles the
/// parent's `reclaimable` and evictability.
#[inline(always)]
fn attach(links: &mut [Link], rows: &[BlockRow], b: u32, parent: u32) {
    let link = &mut links[b as usize];
    (link.parent, link.next, link.prev) = (parent, NO_BLOCK, NO_BLOCK);
    if parent == NO_BLOCK {
        return;
    }
    let first = links[parent as usize].first_child;
    links[b as usize].next = first;
    if first != NO_BLOCK {
        links[first as usize].prev = b;
    }
    let p = &mut links[parent as usize];
    p.first_child = b;
    p.blockers += u32::from(!rows[b as usize].reclaimable);
}

/// Unlinks `b`, a leaf, from its parent's children and returns the parent. The caller settles
/// the parent.
#[inline(always)]
fn detach(links: &mut [Link], rows: &[BlockRow], b: u32) -> u32 {
    let Link {
        parent, next, prev, ..
    } = links[b as usize];
    debug_assert!(
        links[b as usize].is_leaf(),
        "detaching a block with children"
    );
    if prev != NO_BLOCK {
        links[prev as usize].next = next;
    } else if parent != NO_BLOCK {
        links[parent as usize].first_child = next;
    }
    if next != NO_BLOCK {
        links[next as usize].prev = prev;
    }
    if parent != NO_BLOCK {
        links[parent as usize].blockers -= u32::from(!rows[b as usize].reclaimable);
    }
    links[b as usize] = Link::default();
    parent
}

/// Brings block `b`'s `reclaimable` flag up to date (cached, and no indexed child that is not
/// reclaimable), and its ancestors' as far as the change reaches.
#[inline(always)]
fn settle_reclaimable(rows: &mut [BlockRow], links: &mut [Link], queues: &mut [PoolCache], b: u32) {
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

/// All blocks, indexed by block id.
#[derive(Debug, Default, Clone)]
pub(crate) struct Blocks {
    pub(crate) rows: Vec<BlockRow>,
    /// A higher-precision copy kept in a lower tier (write-through), if any.
    pub(crate) copy: Vec<Option<Loc>>,
    /// Places in the prefix tree (prefix-aware cores).
    pub(crate) links: Vec<Link>,
    free_ids: Vec<u32>,
    /// One bit per block id, set while live: batch calls validate ids against this compact
    /// copy (1M blocks in 128 KiB) instead of touching each block's row twice.
    live_bits: Vec<u64>,
}

impl Blocks {
    fn with_capacity(n: usize) -> Blocks {
        Blocks {
            rows: Vec::with_capacity(n),
            copy: Vec::with_capacity(n),
            links: Vec::with_capacity(n),
            free_ids: Vec::new(),
            live_bits: Vec::with_capacity(n.div_ceil(64)),
        }
    }

    /// A new id's row (and its word of the live bitmap).
    fn push_row(&mut self) -> u32 {
        let b = self.rows.len() as u32;
        self.rows.push(BlockRow::default());
        self.copy.push(None);
        self.links.push(Link::default());
        self.live_bits.resize(self.rows.len().div_ceil(64), 0);
        b
    }

    #[inline]
    fn set_live(&mut self, b: u32, live: bool) {
        self.rows[b as usize].live = live;
        let (word, bit) = ((b / 64) as usize, b % 64);
        if live {
            self.live_bits[word] |= 1 << bit;
        } else {
            self.live_bits[word] &= !(1 << bit);
        }
    }

    pub(crate) fn is_live(&self, b: u32) -> bool {
        self.live_bits
            .get((b / 64) as usize)
            .is_some_and(|w| w >> (b % 64) & 1 == 1)
    }
}

/// The cached blocks of one pool: how many, and two queues in key order (which may also hold
/// stale entries): every cached block, what demotion and offload take; and the cached leaves,
/// what eviction takes (prefix-aware cores; a plain core evicts from the first).
#[derive(Debug, Clone)]
pub(crate) struct PoolCache {
    cached: EvictionQueue,
    leaves: EvictionQueue,
    count: u64,
    /// Of them, those evicting leaf after leaf can free (see `BlockRow::reclaimable`).
    reclaimable: u64,
    slot_bytes: u64,
    /// Pushes left before the queues are next checked for piled-up stale entries.
    pushes_to_check: u64,
}

/// Which queue of a pool: every cached block, or the cached leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cached {
    Any,
    Leaves,
}

impl PoolCache {
    fn new(slot_bytes: u64) -> PoolCache {
        PoolCache {
            cached: EvictionQueue::default(),
            leaves: EvictionQueue::default(),
            count: 0,
            reclaimable: 0,
            slot_bytes,
            pushes_to_check: 1,
        }
    }

    fn queue(&mut self, which: Cached) -> &mut EvictionQueue {
        match which {
            Cached::Any => &mut self.cached,
            Cached::Leaves => &mut self.leaves,
        }
    }

    /// Counts `n` blocks just queued; every so many pushes, drops the stale entries once they
    /// outnumber the live ones (keys change, and each change leaves one behind).
    #[inline(always)]
    fn pushed(&mut self, rows: &[BlockRow], links: &[Link], p: usize, n: u64) {
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
        if self.cached.len() as u64 > bound {
            self.cached.retain(|e| Core::entry_valid(rows, p, e));
        }
        if self.leaves.len() as u64 > bound {
            self.leaves.retain(|e| Core::leaf_valid(rows, links, p, e));
        }
        // A push adds at most one entry to each queue: neither passes the bound sooner than
        // this (give or take the live count shrinking meanwhile, which the next check catches).
        let longest = self.cached.len().max(self.leaves.len()) as u64;
        self.pushes_to_check = (bound + 1).saturating_sub(longest).max(1);
    }

    /// Bytes of the reclaimable blocks (derived: every block moving in or out would pay for a
    /// running sum).
    fn reclaimable_bytes(&self) -> u64 {
        self.reclaimable * self.slot_bytes
    }
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
    /// Position of each tier in the config (`usize::MAX` if absent), by `Tier as usize`.
    tier_at: [usize; 4],
    pub(crate) pending: Option<crate::Plan>,
    pub(crate) next_plan: u64,
    /// `Core::config_may_idle`, derived once: a replay plans after every request.
    pub(crate) plans_may_idle: bool,
    pub(crate) counters: Counters,
    /// Per-block scratch for the scheduler (all `u32::MAX` between plans).
    pub(crate) scratch: Vec<u32>,
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

    // ---- pools and bytes -------------------------------------------------------------------

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

    // ---- block ids -------------------------------------------------------------------------

    pub fn num_block_ids(&self) -> usize {
        self.blocks.rows.len()
    }

    pub fn live_blocks(&self) -> usize {
        self.blocks.rows.len() - self.blocks.free_ids.len()
    }

    pub(crate) fn check_blocks(&self, ids: &[u32]) -> Result<()> {
        for &b in ids {
            if !self.blocks.is_live(b) {
                return Err(Error::UnknownBlock { block: b });
            }
        }
        Ok(())
    }

    /// A free block id, marked live; its row is set by `init_block`.
    fn new_block_id(&mut self) -> u32 {
        let b = match self.blocks.free_ids.pop() {
            Some(b) => b,
            None => {
                let b = self.blocks.push_row();
                self.stats.push(BlockStats::default());
                b
            }
        };
        self.blocks.set_live(b, true);
        b
    }

    /// The row and statistics of a new block with id `b` at the location its row holds,
    /// referenced once and touched now; its content fields (position, fill, hash) from `new`.
    fn init_block(&mut self, b: u32, new: BlockRow) {
        self.clock += 1;
        self.blocks.rows[b as usize].renew(new, self.step, self.clock);
        self.reset_stats(&[b]);
        self.counters.allocated += 1;
    }

    /// The statistics of block ids taken by new blocks.
    #[inline(always)]
    fn reset_stats(&mut self, ids: &[u32]) {
        debug_assert!(
            ids.iter().all(|&b| self.blocks.copy[b as usize].is_none()),
            "a released block keeps no copy"
        );
        if self.stats_written {
            for &b in ids {
                self.stats[b as usize] = BlockStats::default();
            }
        }
    }

    /// Frees a block whose last reference is gone: its slots, its index entry, its id.
    pub(crate) fn release_block(&mut self, b: u32) {
        self.detach_block(b);
        self.free_id_and_slot(b);
    }

    /// What releasing a block takes besides its id and slot: its cache-index and prefix-index
    /// entries (and, prefix-aware, its place in the tree) and its lower-tier copy.
    #[inline(always)]
    fn detach_block(&mut self, b: u32) {
        self.leave_cache(b);
        debug_assert!({
            let row = &self.blocks.rows[b as usize];
            row.live && row.refcount == 0 && !row.moving
        });
        self.leave_prefix_index(b);
        self.settle_block(b);
        self.release_copy(b);
        self.counters.released += 1;
    }

    /// Gives back the slot of a block's lower-tier copy, if it has one.
    #[inline(always)]
    fn release_copy(&mut self, b: u32) {
        // Copies live in a lower tier: with one tier there are none to look up.
        if self.cfg.tiers.len() > 1 {
            if let Some(copy) = self.blocks.copy[b as usize].take() {
                self.give_slot(copy);
            }
        }
    }

    #[inline]
    fn free_id_and_slot(&mut self, b: u32) {
        let loc = self.blocks.rows[b as usize].loc;
        self.blocks.set_live(b, false);
        self.give_slot(loc);
        self.blocks.free_ids.push(b);
    }

    /// Releases a block nobody needs any more: unreferenced, unpinned, not moving, and either
    /// not indexed or dropped (a dropped block cannot serve a prefix hit).
    pub(crate) fn release_if_orphan(&mut self, b: u32) {
        let i = b as usize;
        let bl = &self.blocks;
        let row = &bl.rows[i];
        // `indexed` first: a freed request's blocks are mostly cached.
        if !row.indexed && row.live && row.refcount == 0 && row.pins == 0 && !row.moving {
            self.release_block(b);
        }
    }

    // ---- the prefix tree -----------------------------------------------------------------------

    /// Whether blocks form prefix trees (`Config::prefix_aware`).
    #[inline(always)]
    pub(crate) fn prefix_aware(&self) -> bool {
        self.cfg.prefix_aware
    }

    /// The parent a block at `position` whose hash chains on from `prev` takes in the prefix
    /// tree: `NO_BLOCK` for a root (position 0, or a plain core), the block indexed under `prev`
    /// otherwise. `None`: none is, and the block must not be indexed (it would be stranded).
    #[inline(always)]
    fn parent_for(&self, position: u32, prev: u64) -> Option<u32> {
        if !self.prefix_aware() || position == 0 {
            return Some(NO_BLOCK);
        }
        self.index.get(prev)
    }

    /// Indexes block `b` under `hash` with `parent` (from `parent_for`) unless another block
    /// holds that hash; returns whether it did.
    pub(crate) fn index_block(&mut self, b: u32, hash: u64, parent: Option<u32>) -> bool {
        let Some(parent) = parent else {
            return false;
        };
        if !self.index.insert(hash, b) {
            return false;
        }
        self.blocks.rows[b as usize].indexed = true;
        if self.prefix_aware() {
            attach(&mut self.blocks.links, &self.blocks.rows, b, parent);
            if parent != NO_BLOCK {
                self.settle_block(parent);
            }
        }
        true
    }

    /// Takes `b` out of the prefix index, with every indexed descendant first (a block whose
    /// parent is gone can never load). A descendant that nothing else holds is released;
    /// one a sequence references stays, private to it.
    pub(crate) fn leave_prefix_index(&mut self, b: u32) {
        if !self.blocks.rows[b as usize].indexed {
            return;
        }
        if !self.blocks.links[b as usize].is_leaf() {
            // Descendants in preorder; leaving in reverse takes each after its own.
            let mut order = Vec::new();
            let mut stack = vec![self.blocks.links[b as usize].first_child];
            while let Some(mut c) = stack.pop() {
                while c != NO_BLOCK {
                    order.push(c);
                    let link = &self.blocks.links[c as usize];
                    stack.push(link.first_child);
                    c = link.next;
                }
            }
            for &c in order.iter().rev() {
                self.unindex_leaf(c);
                self.refresh_evictable(c);
                self.release_if_orphan(c);
            }
        }
        self.unindex_leaf(b);
    }

    /// Takes an indexed block without indexed children out of the prefix index and the tree;
    /// its parent may become a leaf.
    fn unindex_leaf(&mut self, b: u32) {
        let row = &mut self.blocks.rows[b as usize];
        row.indexed = false;
        let hash = row.hash;
        self.index.remove(hash, b);
        if self.prefix_aware() {
            let parent = detach(&mut self.blocks.links, &self.blocks.rows, b);
            if parent != NO_BLOCK {
                self.refresh_evictable(parent); // a leaf now, perhaps
            }
        }
    }

    /// Takes a leaf planned for eviction out of the prefix tree (it stays indexed, its bytes
    /// where they are, until the plan commits), so that its parent may become a leaf and go
    /// in the same plan. Returns its parent's hash, for [`Core::unpark`] (`None`: a root).
    pub(crate) fn park(&mut self, b: u32) -> Option<u64> {
        let parent = detach(&mut self.blocks.links, &self.blocks.rows, b);
        if parent == NO_BLOCK {
            return None;
        }
        self.refresh_evictable(parent); // a leaf now, perhaps
        Some(self.blocks.rows[parent as usize].hash)
    }

    /// Links a parked block back into the tree (its eviction was cancelled): under the block
    /// indexed under `parent_hash` now; if none is (the parent left meanwhile), the block
    /// leaves the index too (it could never load).
    pub(crate) fn unpark(&mut self, b: u32, parent_hash: Option<u64>) {
        let row = &self.blocks.rows[b as usize];
        if !row.live || !row.indexed || self.blocks.links[b as usize].parent != NO_BLOCK {
            return;
        }
        let parent = match parent_hash {
            None => NO_BLOCK,
            Some(h) => match self.index.get(h) {
                Some(p) => p,
                None => {
                    self.leave_prefix_index(b);
                    return;
                }
            },
        };
        attach(&mut self.blocks.links, &self.blocks.rows, b, parent);
        if parent != NO_BLOCK {
            self.refresh_evictable(parent); // not a leaf any more
        }
    }

    // ---- the cache index -------------------------------------------------------------------------

    #[inline]
    fn is_cached(&self, b: usize) -> bool {
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
    fn settle_block(&mut self, b: u32) {
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
    fn leave_cache(&mut self, b: u32) {
        self.blocks.rows[b as usize].leave_cache(&mut self.caches);
    }

    /// `refresh_evictable` for a change that can only make a block not cached.
    pub(crate) fn refresh_evictable_if_indexed(&mut self, b: u32) {
        if self.blocks.rows[b as usize].cached_in != NOT_CACHED {
            self.refresh_evictable(b);
        }
    }

    /// Whether a cache-index entry of `pool` still stands for its block.
    fn entry_valid(rows: &[BlockRow], pool: usize, t: &Ticket) -> bool {
        let row = &rows[t.block as usize];
        row.cached_in as usize == pool && row.version == t.version
    }

    /// Whether a leaf-queue entry of `pool` still stands for its block: valid, and a leaf.
    fn leaf_valid(rows: &[BlockRow], links: &[Link], pool: usize, t: &Ticket) -> bool {
        Self::entry_valid(rows, pool, t) && links[t.block as usize].is_leaf()
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

    #[inline(always)]
    fn pool_map(&self) -> PoolMap {
        PoolMap {
            tier_at: self.tier_at,
            levels: self.cfg.num_levels(),
        }
    }

    /// The lowest-ranked block of a pool's queue `which`, left in place.
    #[inline]
    pub(crate) fn peek_cached(&mut self, pool: usize, which: Cached) -> Option<(Key, u32)> {
        let ranking = Ranking {
            cfg: &self.cfg,
            decay: &self.decay,
            stats: &self.stats,
        }; // not self.ranking(): the queue below is borrowed mutably
        let (rows, links) = (&self.blocks.rows, &self.blocks.links);
        let queue = self.caches[pool].queue(which);
        let top = match which {
            Cached::Any => queue.peek_valid(
                |t| Self::entry_valid(rows, pool, t),
                |b| ranking.key(b as usize, &rows[b as usize]),
            ),
            Cached::Leaves => queue.peek_valid(
                |t| Self::leaf_valid(rows, links, pool, t),
                |b| ranking.evict_key(b as usize, &rows[b as usize]),
            ),
        };
        top.map(|e| (e.key, e.ticket.block))
    }

    /// Takes the lowest-ranked entry of a pool's queue of every cached block out of it (the
    /// block stays cached: the caller puts the entry back).
    pub(crate) fn pop_cached(&mut self, pool: usize) -> Option<(Key, Ticket)> {
        let ranking = Ranking {
            cfg: &self.cfg,
            decay: &self.decay,
            stats: &self.stats,
        };
        let rows = &self.blocks.rows;
        let key_of = |b: u32| ranking.key(b as usize, &rows[b as usize]);
        let t = self.caches[pool]
            .cached
            .pop_valid(|t| Self::entry_valid(rows, pool, t), key_of)?;
        Some((key_of(t.block), t))
    }

    /// Puts an entry taken by [`Core::pop_cached`] back, if it still stands for its block.
    pub(crate) fn restore_cached(&mut self, pool: usize, key: Key, ticket: Ticket) {
        if Self::entry_valid(&self.blocks.rows, pool, &ticket) {
            self.caches[pool].cached.push(key, ticket);
        }
    }

    /// The lowest-ranked block of queue `which` among `pools`.
    #[inline]
    pub(crate) fn lowest_cached(
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
        pools: impl IntoIterator<Item = usize>,
    ) -> Option<(Key, u32)> {
        let which = self.victims();
        self.lowest_cached(pools, which)
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
            &mut cache.cached,
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
        if self.cfg.tiers.len() > 1 {
            for i in first..self.recycled.len() {
                self.release_copy(self.recycled[i]);
            }
        }
    }

    /// Frees the recycled blocks no new block took, as evicting them would have, in the
    /// order they were evicted: ids and slots are handed out as if each went through the
    /// free lists.
    fn release_recycled(&mut self) {
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
        self.counters.evictions += 1;
        self.release_block(b);
    }

    /// Evicts cached blocks until one level-0 slot of the device is free: its lowest-ranked
    /// leaf, else (its reclaimable blocks all have children elsewhere) the lowest-ranked of
    /// them, leaves of its subtree first. False if the pool holds nothing reclaimable.
    fn evict_level0_slot(&mut self) -> bool {
        let pool = self.pool_index(Tier::Device, 0);
        let which = self.victims();
        if let Some((_, b)) = self.peek_cached(pool, which) {
            self.evict_now(b);
            return true;
        }
        if self.caches[pool].reclaimable == 0 {
            return false;
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
            self.caches[pool].cached.push(key, ticket);
        }
        let Some(top) = found else {
            return false;
        };
        // Every descendant of a reclaimable block is cached: the first leaf down goes.
        let mut leaf = top;
        while !self.blocks.links[leaf as usize].is_leaf() {
            leaf = self.blocks.links[leaf as usize].first_child;
        }
        self.evict_now(leaf);
        true
    }

    pub(crate) fn stats_mut(&mut self) -> &mut [BlockStats] {
        self.stats_written = true;
        &mut self.stats
    }

    // ---- ranking -------------------------------------------------------------------------------

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

    /// The eviction key of a block (see [`Ranking::evict_key`]).
    #[inline(always)]
    pub(crate) fn evict_key(&self, b: usize) -> Key {
        self.ranking().evict_key(b, &self.blocks.rows[b])
    }

    // ---- sequences -----------------------------------------------------------------------------

    /// A new, empty sequence, hashed in the core's namespace.
    pub fn add_sequence(&mut self) -> u32 {
        self.add_sequence_seeded(self.cfg.namespace)
    }

    /// A new, empty sequence whose block hashes are salted with `salt` (a tenant id, vLLM's
    /// `cache_salt`): it shares blocks only with sequences of the same salt, in this core and
    /// through every key made of its hashes. `None` is [`Core::add_sequence`]; an empty salt is
    /// refused. Its forks keep the salt (they continue its hash chain).
    pub fn add_sequence_salted(&mut self, salt: Option<&str>) -> Result<u32> {
        let seed = crate::prefix::chain_seed(self.cfg.namespace, salt)?;
        Ok(self.add_sequence_seeded(seed))
    }

    fn add_sequence_seeded(&mut self, seed: u64) -> u32 {
        let id = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let blocks = self.spare_block_lists.pop().unwrap_or_default();
        self.seqs.insert(
            id,
            Sequence {
                blocks,
                chain: seed,
                ..Sequence::default()
            },
        );
        id
    }

    fn seq(&self, seq: u32) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or(Error::UnknownSequence { seq })
    }

    pub fn sequence_blocks(&self, seq: u32) -> Result<&[u32]> {
        Ok(&self.seq(seq)?.blocks)
    }

    pub fn sequence_tokens(&self, seq: u32) -> Result<u64> {
        Ok(self.seq(seq)?.tokens)
    }

    /// Ids of the live sequences, in increasing order.
    pub fn sequence_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.seqs.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Makes room on the device for `n` new level-0 blocks, evicting cached blocks when the
    /// config allows; checks first, so on failure nothing was evicted. Blocks evicted from the
    /// level-0 pool are left `recycled` for the new blocks: the caller allocates with
    /// `new_device_block`, then calls `release_recycled`.
    fn ensure_device_room(&mut self, n: u64) -> Result<()> {
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
                let freed = self.evict_level0_slot();
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
    fn new_device_id(&mut self) -> u32 {
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

    /// A new level-0 device block (see [`Core::new_device_id`]) holding `fill` tokens at
    /// `position` of its sequence; with `(hash, the hash before it)`, it is indexed under the
    /// hash unless another block has it (or, prefix-aware, no block has the one before).
    fn new_device_block(&mut self, position: u32, fill: u32, hash: Option<(u64, u64)>) -> u32 {
        let b = self.new_device_id();
        let new = BlockRow {
            position,
            fill,
            hash: hash.map_or(0, |(h, _)| h),
            ..BlockRow::default()
        };
        self.init_block(b, new);
        if let Some((h, prev)) = hash {
            let parent = self.parent_for(position, prev);
            self.index_block(b, h, parent);
        }
        b
    }

    fn share(&mut self, b: u32) {
        self.blocks.rows[b as usize].refcount += 1;
        self.counters.shared_hits += 1;
        self.refresh_evictable(b); // referenced: not cached
    }

    /// Appends full blocks given by their (already chained) hashes — how a trace replays. A hash
    /// already in the index shares that block; the others get new level-0 device blocks.
    pub fn append_blocks(&mut self, seq: u32, hashes: &[u64]) -> Result<Appended> {
        let mut out = Appended::default();
        self.append_blocks_into(seq, hashes, &mut out, false)?;
        Ok(out)
    }

    /// [`Core::append_blocks`] into the caller's buffers (cleared first), so that a replay
    /// allocates none per request. With `read`, the appended blocks are also read, as
    /// [`Core::record_reads`] of them right after would (same statistics, same access clock),
    /// in the same pass.
    pub(crate) fn append_blocks_into(
        &mut self,
        seq: u32,
        hashes: &[u64],
        out: &mut Appended,
        read: bool,
    ) -> Result<()> {
        let bs = u64::from(self.cfg.block_size);
        let s = self.seq(seq)?;
        if s.tokens % bs != 0 {
            return Err(Error::InvalidArgument {
                what: "append_blocks",
                reason: format!("sequence {seq} ends in a partial block; append tokens instead"),
            });
        }
        let start = s.blocks.len() as u32;
        // One lookup per hash. The shared blocks are referenced first so that making room
        // cannot evict them; the new ones are filled in after.
        out.blocks.clear();
        out.shared.clear();
        let missing = share_indexed(
            &self.index,
            &mut self.blocks.rows,
            &mut self.blocks.links,
            &mut self.caches,
            hashes,
            out,
        );
        self.counters.shared_hits += hashes.len() as u64 - missing;
        if let Err(e) = self.ensure_device_room(missing) {
            for (&b, _) in out.blocks.iter().zip(&out.shared).filter(|p| *p.1) {
                self.unshare(b);
            }
            return Err(e);
        }
        // The new blocks' ids, in the order `new_device_id` gives them (the last evicted
        // first, then fresh ones), then the fill-in.
        let mut ids = std::mem::take(&mut self.new_ids);
        let reused = self.recycled.len().min(missing as usize);
        ids.extend(self.recycled.drain(self.recycled.len() - reused..).rev());
        ids.extend((reused..missing as usize).map(|_| self.new_device_id()));
        self.release_recycled();
        let fresh = NewBlocks {
            ids: &ids,
            start,
            fill: self.cfg.block_size,
            step: self.step,
            clock: self.clock,
        };
        let counts = self.decay.if_counted(self.cfg.policy);
        let (rows, index) = (&mut self.blocks.rows, &mut self.index);
        self.clock = fresh.fill_in(rows, index, out, hashes, read, counts);
        self.reset_stats(&ids);
        self.counters.allocated += missing;
        ids.clear();
        self.new_ids = ids;
        if self.prefix_aware() && missing > 0 {
            let prev = self.seqs[&seq].chain;
            self.link_new_blocks(start, prev, hashes, out);
        }
        let s = self.seqs.get_mut(&seq).expect("checked above");
        s.blocks.extend_from_slice(&out.blocks);
        s.tokens += bs * hashes.len() as u64;
        if let Some(&h) = hashes.last() {
            s.chain = h;
        }
        Ok(())
    }

    /// Puts the new blocks an append indexed (`fill_in`) into the prefix tree, each under the
    /// block indexed before it (`prev`: the hash before the first); one whose parent is not
    /// indexed leaves the index again (it would be stranded), and so do the blocks after it.
    /// A parent must be older than the append or linked before it in this one: hashes that
    /// repeat (a trace's, a caller's) could otherwise make a block its own ancestor.
    #[inline(never)]
    fn link_new_blocks(&mut self, start: u32, prev: u64, hashes: &[u64], out: &Appended) {
        // `scratch` marks the blocks still to link (all `u32::MAX` between calls).
        let mut unlinked = std::mem::take(&mut self.scratch);
        unlinked.resize(self.num_block_ids(), u32::MAX);
        let new = |k: usize| !out.shared[k];
        for (k, &b) in out.blocks.iter().enumerate() {
            if new(k) {
                unlinked[b as usize] = 0;
            }
        }
        for (k, &b) in out.blocks.iter().enumerate().filter(|&(k, _)| new(k)) {
            let before = if k == 0 { prev } else { hashes[k - 1] };
            let parent = self
                .parent_for(start + k as u32, before)
                .filter(|&p| p == NO_BLOCK || unlinked[p as usize] == u32::MAX);
            unlinked[b as usize] = u32::MAX;
            if !self.blocks.rows[b as usize].indexed {
                continue;
            }
            match parent {
                Some(parent) => {
                    attach(&mut self.blocks.links, &self.blocks.rows, b, parent);
                    if parent != NO_BLOCK {
                        self.settle_block(parent);
                    }
                }
                None => {
                    self.blocks.rows[b as usize].indexed = false;
                    self.index.remove(hashes[k], b);
                }
            }
        }
        self.scratch = unlinked;
    }

    fn unshare(&mut self, b: u32) {
        self.blocks.rows[b as usize].refcount -= 1;
        self.counters.shared_hits -= 1;
        self.refresh_evictable(b);
    }

    /// Appends token ids. Whole blocks whose chained hash is indexed are shared; other blocks are
    /// new. A trailing partial block is hashed (and indexed) once it fills.
    pub fn append_tokens(&mut self, seq: u32, tokens: &[u32]) -> Result<Appended> {
        let bs = self.cfg.block_size as usize;
        let s = self.seq(seq)?;
        if s.opaque {
            return self.extend(seq, tokens.len() as u64);
        }
        let fill = (s.tokens % bs as u64) as usize;
        // Plan the blocks first (pure), then reference, make room, and write.
        let head = if fill > 0 {
            (bs - fill).min(tokens.len())
        } else {
            0
        };
        let rest = &tokens[head..];
        let mut chain = s.chain;
        if fill > 0 && fill + head == bs {
            let mut full = s.partial.clone();
            full.extend_from_slice(&tokens[..head]);
            chain = chain_hash(chain, &full);
        }
        let mut new_blocks: Vec<PlannedBlock> = Vec::new();
        for chunk in rest.chunks(bs) {
            if chunk.len() == bs {
                let prev = chain;
                chain = chain_hash(chain, chunk);
                new_blocks.push((Some((chain, prev)), self.index.get(chain), bs));
            } else {
                new_blocks.push((None, None, chunk.len()));
            }
        }
        for b in new_blocks.iter().filter_map(|n| n.1) {
            self.share(b);
        }
        let missing = new_blocks.iter().filter(|n| n.1.is_none()).count() as u64;
        if let Err(e) = self.ensure_device_room(missing) {
            for b in new_blocks.iter().filter_map(|n| n.1) {
                self.unshare(b);
            }
            return Err(e);
        }

        let mut s = self.seqs.remove(&seq).expect("checked above");
        if head > 0 {
            let last = *s.blocks.last().expect("a partial block exists");
            s.partial.extend_from_slice(&tokens[..head]);
            self.blocks.rows[last as usize].fill += head as u32;
            if s.partial.len() == bs {
                let (prev, h) = (s.chain, chain_hash(s.chain, &s.partial));
                s.chain = h;
                s.partial.clear();
                self.blocks.rows[last as usize].hash = h;
                // An identical block may already be indexed; this one then stays private.
                let position = self.blocks.rows[last as usize].position;
                let parent = self.parent_for(position, prev);
                self.index_block(last, h, parent);
            }
        }
        let mut out = Appended::default();
        let mut offset = 0;
        for (hash, shared, len) in new_blocks {
            let position = s.blocks.len() as u32;
            let b = match shared {
                Some(b) => b,
                None => self.new_device_block(position, len as u32, hash),
            };
            if let Some((h, _)) = hash {
                s.chain = h;
            } else {
                s.partial = rest[offset..offset + len].to_vec();
            }
            offset += len;
            s.blocks.push(b);
            out.blocks.push(b);
            out.shared.push(shared.is_some());
        }
        self.release_recycled();
        s.tokens += tokens.len() as u64;
        self.seqs.insert(seq, s);
        Ok(out)
    }

    /// Appends `n` tokens whose ids the engine does not give (it only has their K/V). Their
    /// blocks are never hashed, and the sequence becomes opaque: with a gap in its token ids, no
    /// later block of it can be named by a prefix hash, so none is indexed or shared.
    pub fn extend(&mut self, seq: u32, n: u64) -> Result<Appended> {
        let bs = u64::from(self.cfg.block_size);
        let s = self.seq(seq)?;
        let fill = s.tokens % bs;
        let head = if fill > 0 { (bs - fill).min(n) } else { 0 };
        self.ensure_device_room((n - head).div_ceil(bs))?;
        let mut s = self.seqs.remove(&seq).expect("checked above");
        s.opaque = true;
        s.partial.clear();
        if head > 0 {
            let last = *s.blocks.last().expect("a partial block exists");
            self.blocks.rows[last as usize].fill += head as u32;
        }
        let mut out = Appended::default();
        let mut rest = n - head;
        while rest > 0 {
            let len = rest.min(bs);
            let b = self.new_device_block(s.blocks.len() as u32, len as u32, None);
            s.blocks.push(b);
            out.blocks.push(b);
            out.shared.push(false);
            rest -= len;
        }
        self.release_recycled();
        s.tokens += n;
        self.seqs.insert(seq, s);
        Ok(out)
    }

    /// A child sequence sharing the parent's full blocks. The parent's partial block, if any, is
    /// copied into a new block of the child: the engine copies its bytes (`Forked::copy`).
    pub fn fork(&mut self, parent: u32) -> Result<Forked> {
        let s = self.seq(parent)?;
        let bs = u64::from(self.cfg.block_size);
        let partial = if s.tokens % bs != 0 {
            s.blocks.last().copied()
        } else {
            None
        };
        if partial.is_some() {
            self.ensure_device_room(1)?;
        }
        let s = self.seqs.get(&parent).expect("checked above").clone();
        let full = if partial.is_some() {
            &s.blocks[..s.blocks.len() - 1]
        } else {
            &s.blocks[..]
        };
        for &b in full {
            self.blocks.rows[b as usize].refcount += 1;
            self.refresh_evictable(b);
        }
        let mut child = s.clone();
        let copy = partial.map(|src| {
            let row = &self.blocks.rows[src as usize];
            let dst = self.new_device_block(row.position, row.fill, None);
            *child.blocks.last_mut().expect("partial block") = dst;
            (src, dst)
        });
        self.release_recycled();
        let id = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.seqs.insert(id, child);
        Ok(Forked { child: id, copy })
    }

    /// Drops the sequence's references. Indexed blocks stay cached for later prefix hits;
    /// the rest are freed.
    pub fn free_sequence(&mut self, seq: u32) -> Result<()> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        if self.cfg.policy == PolicyKind::Importance {
            // Cached blocks are ranked by the importance they keep from their last sequence:
            // normalise it now, or a sequence freed before any plan (a save: add, write, free)
            // would leave its blocks unranked by magnitude and learned scores.
            self.normalise_importance(&s.blocks);
        }
        let pools = self.pool_map();
        let mut orphans = std::mem::take(&mut self.orphans);
        let Core {
            cfg,
            decay,
            stats,
            blocks,
            caches,
            ..
        } = self;
        let ranking = Ranking { cfg, decay, stats };
        drop_refs(
            &mut blocks.rows,
            &mut blocks.links,
            caches,
            ranking,
            pools,
            cfg.prefix_aware,
            &s.blocks,
            &mut orphans,
        );
        for &b in &orphans {
            self.release_if_orphan(b);
        }
        orphans.clear();
        self.orphans = orphans;
        let mut blocks = s.blocks;
        blocks.clear();
        self.spare_block_lists.push(blocks);
        Ok(())
    }

    /// Takes blocks out of the prefix index (their bytes are incomplete and must not be shared
    /// again), prefix-aware with every block after them in a cached prefix (those could never
    /// load); each is freed once nothing references it.
    pub fn forget(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        for &b in ids {
            if self.blocks.rows[b as usize].indexed {
                self.leave_prefix_index(b);
                self.refresh_evictable(b);
                self.release_if_orphan(b);
            }
        }
        Ok(())
    }

    // ---- prefix lookup ------------------------------------------------------------------------

    /// Blocks of the longest indexed prefix of `hashes`.
    pub fn lookup(&self, hashes: &[u64]) -> Vec<u32> {
        self.index.longest_prefix(hashes)
    }

    /// Blocks of the longest indexed prefix of a token sequence (full blocks only).
    pub fn lookup_tokens(&self, tokens: &[u32]) -> Vec<u32> {
        self.lookup_seeded(tokens, self.cfg.namespace)
    }

    /// [`Core::lookup_tokens`] for a sequence salted with `salt` (see
    /// [`Core::add_sequence_salted`]): only blocks of sequences with the same salt match.
    pub fn lookup_tokens_salted(&self, tokens: &[u32], salt: Option<&str>) -> Result<Vec<u32>> {
        let seed = crate::prefix::chain_seed(self.cfg.namespace, salt)?;
        Ok(self.lookup_seeded(tokens, seed))
    }

    fn lookup_seeded(&self, tokens: &[u32], seed: u64) -> Vec<u32> {
        let hashes = crate::prefix::prefix_hashes(tokens, self.cfg.block_size as usize, seed);
        self.lookup(&hashes)
    }

    // ---- statistics, in batches ----------------------------------------------------------------

    /// Counts a read of each listed block (a block listed twice is read twice).
    pub fn record_reads(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        self.read_blocks(ids);
        Ok(())
    }

    /// [`Core::record_reads`] of blocks known to be live.
    fn read_blocks(&mut self, ids: &[u32]) {
        for &b in ids {
            self.clock += 1;
            let row = &mut self.blocks.rows[b as usize];
            row.read(
                self.decay.if_counted(self.cfg.policy),
                self.step,
                self.clock,
            );
            if row.cached_in != NOT_CACHED {
                self.refresh_evictable(b); // its recency is part of its key
            }
        }
    }

    /// Attention mass each block received in one report, aggregated over heads and queries as
    /// the caller sees fit (`BlockManager` averages them and reports each layer). Blocks at or
    /// above the report's mean count as important for Scissorhands.
    pub fn record_attention(&mut self, ids: &[u32], mass: &[f32]) -> Result<()> {
        self.check_values("attention mass", ids, mass)?;
        let mean = mass.iter().map(|&m| f64::from(m)).sum::<f64>() / mass.len().max(1) as f64;
        let alpha = self.cfg.attention_ema;
        for (&b, &m) in ids.iter().zip(mass) {
            let i = b as usize;
            let s = &mut self.stats_mut()[i];
            s.attn_ema = if s.known & KNOWN_ATTENTION != 0 {
                alpha * m + (1.0 - alpha) * s.attn_ema
            } else {
                m
            };
            s.attn_sum += m;
            s.attn_history = (s.attn_history << 1) | u32::from(f64::from(m) >= mean);
            s.known |= KNOWN_ATTENTION;
            if self.blocks.rows[i].cached_in != NOT_CACHED {
                self.refresh_evictable(b);
            }
        }
        Ok(())
    }

    /// Key/value magnitude of each block, computed when it was written.
    pub fn set_magnitude(&mut self, ids: &[u32], values: &[f32]) -> Result<()> {
        self.check_values("magnitude", ids, values)?;
        for (&b, &v) in ids.iter().zip(values) {
            let s = &mut self.stats_mut()[b as usize];
            s.magnitude = v;
            s.known |= KNOWN_MAGNITUDE;
        }
        Ok(())
    }

    /// A learned importance score of each block (e.g. a probe on key features).
    pub fn set_learned(&mut self, ids: &[u32], values: &[f32]) -> Result<()> {
        self.check_values("learned score", ids, values)?;
        for (&b, &v) in ids.iter().zip(values) {
            let s = &mut self.stats_mut()[b as usize];
            s.learned = v;
            s.known |= KNOWN_LEARNED;
        }
        Ok(())
    }

    fn check_values(&self, what: &'static str, ids: &[u32], values: &[f32]) -> Result<()> {
        if ids.len() != values.len() {
            return Err(Error::LengthMismatch {
                what,
                expected: ids.len(),
                got: values.len(),
            });
        }
        if let Some(v) = values.iter().find(|v| !v.is_finite() || **v < 0.0) {
            return Err(Error::InvalidArgument {
                what,
                reason: format!("{v} is not a finite non-negative number"),
            });
        }
        self.check_blocks(ids)
    }

    // ---- pins ---------------------------------------------------------------------------------

    /// Pins blocks the engine is reading: the scheduler never moves or evicts them.
    pub fn pin(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        for &b in ids {
            self.blocks.rows[b as usize].pins += 1;
            self.refresh_evictable(b);
        }
        Ok(())
    }

    pub fn unpin(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        let mut count: BTreeMap<u32, u32> = BTreeMap::new();
        for &b in ids {
            *count.entry(b).or_default() += 1;
        }
        if let Some((&b, _)) = count
            .iter()
            .find(|(b, n)| self.blocks.rows[**b as usize].pins < **n)
        {
            return Err(Error::InvalidArgument {
                what: "unpin",
                reason: format!("block {b} is not pinned"),
            });
        }
        for &b in ids {
            self.blocks.rows[b as usize].pins -= 1;
            self.refresh_evictable(b);
            self.release_if_orphan(b);
        }
        Ok(())
    }

    // ---- inspection ----------------------------------------------------------------------------

    pub fn block_loc(&self, b: u32) -> Result<Loc> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.rows[b as usize].loc)
    }

    pub fn block_copy(&self, b: u32) -> Result<Option<Loc>> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.copy[b as usize])
    }

    pub fn block_refcount(&self, b: u32) -> Result<u32> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.rows[b as usize].refcount)
    }

    pub fn block_pinned(&self, b: u32) -> Result<bool> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.rows[b as usize].pins > 0)
    }

    pub fn block_hash(&self, b: u32) -> Result<Option<u64>> {
        self.check_blocks(&[b])?;
        let i = b as usize;
        Ok((self.blocks.rows[i].fill == self.cfg.block_size).then_some(self.blocks.rows[i].hash))
    }

    pub fn block_position(&self, b: u32) -> Result<u32> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.rows[b as usize].position)
    }

    pub fn block_score(&self, b: u32) -> Result<Key> {
        self.check_blocks(&[b])?;
        Ok(self.key(b as usize))
    }

    pub fn cached_blocks(&self) -> u64 {
        self.caches.iter().map(|e| e.count).sum()
    }

    /// What evicting could free now, per pool: `(tier, level, blocks, bytes)` of its
    /// reclaimable blocks (cached, and, prefix-aware, with every indexed descendant cached:
    /// eviction takes leaves, so a block whose subtree holds a referenced, pinned or moving
    /// block cannot go yet).
    pub fn reclaimable(&self) -> Vec<(Tier, u8, u64, u64)> {
        let levels = self.cfg.num_levels();
        self.caches
            .iter()
            .enumerate()
            .map(|(p, e)| {
                (
                    self.cfg.tiers[p / levels].tier,
                    (p % levels) as u8,
                    e.reclaimable,
                    e.reclaimable_bytes(),
                )
            })
            .collect()
    }

    /// The parent of an indexed block in the prefix tree (`None` for a root, an unindexed
    /// block, or a plain core).
    pub fn block_parent(&self, b: u32) -> Result<Option<u32>> {
        self.check_blocks(&[b])?;
        let parent = self.blocks.links[b as usize].parent;
        Ok((self.blocks.rows[b as usize].indexed && parent != NO_BLOCK).then_some(parent))
    }

    /// Whether a block is in the prefix index (a later prompt with its prefix can share it).
    pub fn block_indexed(&self, b: u32) -> Result<bool> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.rows[b as usize].indexed)
    }

    /// Whether allocations may evict cached blocks (`Config::evict_on_full`). An engine that
    /// lets a plan demote and offload first allows it only for its retry.
    pub fn set_evict_on_full(&mut self, on: bool) {
        self.cfg.evict_on_full = on;
    }
}

/// Enters block `b`, in no cache index, into its pool's if it is cached now: the queue of every
/// cached block (ranked by its key), and the leaf queue too (by its eviction key) when `leaves`
/// (prefix-aware) and it is a leaf. Counts it (as reclaimable too if its flag says so; the caller settles the flag).
/// Takes the core's parts apart (rows, queues) so that a loop over many blocks keeps them at
/// hand instead of reloading them from the core after every write.
#[inline(always)]
fn enqueue_if_cached(
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
    q.cached.push(key, ticket);
    if leaves && links[i].is_leaf() {
        q.leaves.push(evict_key, ticket);
    }
    q.pushed(rows, links, p, 1);
}

/// The lookup pass of an append: each hash's indexed block, referenced at once (shared) so that
/// making room for the others cannot evict it, else `NO_SLOT`, onto `out` (which says which it
/// shared). Returns how many are missing. The caller counts the shared hits.
#[inline(never)] // a call boundary: its &mut arguments do not alias
fn share_indexed(
    index: &PrefixIndex,
    rows: &mut [BlockRow],
    links: &mut [Link],
    queues: &mut [PoolCache],
    hashes: &[u64],
    out: &mut Appended,
) -> u64 {
    let first = out.blocks.len();
    let mut missing = 0;
    // `extend` from exact-size iterators: one capacity check per request, not per block.
    out.blocks
        .extend(hashes.iter().map(|&h| match index.get(h) {
            Some(b) => {
                let row = &mut rows[b as usize];
                row.refcount += 1;
                row.leave_cache(queues); // referenced: not cached
                settle_reclaimable(rows, links, queues, b);
                b
            }
            None => {
                missing += 1;
                NO_SLOT
            }
        }));
    out.shared
        .extend(out.blocks[first..].iter().map(|&b| b != NO_SLOT));
    missing
}

/// The new blocks of an append, about to be filled in: their ids (taken in order), where the
/// append starts, their fill, and the clocks before them.
struct NewBlocks<'a> {
    ids: &'a [u32],
    start: u32,
    fill: u32,
    step: u32,
    clock: u64,
}

impl NewBlocks<'_> {
    /// Gives each `NO_SLOT` of `out.blocks` (hash `hashes[k]`) the next new id, indexes it
    /// and writes its row, touched at the next tick of the access clock. With `read`, then
    /// reads every appended block in order, as `record_reads` of them would (a new block is
    /// written as read once), counting reads with `counts` (see [`DecayTable::if_counted`]).
    /// Returns the access clock after it all.
    #[inline(never)] // a call boundary: its &mut arguments do not alias
    fn fill_in(
        &self,
        rows: &mut [BlockRow],
        index: &mut PrefixIndex,
        out: &mut Appended,
        hashes: &[u64],
        read: bool,
        counts: Option<&DecayTable>,
    ) -> u64 {
        let mut ids = self.ids.iter();
        let mut table = index.table(self.ids.len());
        let mut tick = self.clock;
        // The reads come after every allocation, in block order: the access clock reads
        // `reads_from + k + 1` at block `k`, as a separate `record_reads` would leave it.
        let reads_from = self.clock + self.ids.len() as u64;
        // A new block that is read has been read once: 0 decayed by nothing, plus one.
        let new_reads = if read && counts.is_some() { 1.0 } else { 0.0 };
        // Plain indices over slices of one length: no bounds checks, no iterator adapters.
        let n = hashes.len();
        let (blocks, shared) = (&mut out.blocks[..n], &out.shared[..n]);
        for k in 0..n {
            let read_tick = reads_from + k as u64 + 1;
            if shared[k] {
                if read {
                    // Referenced by this sequence: in no eviction index to refresh.
                    rows[blocks[k] as usize].read(counts, self.step, read_tick);
                }
                continue;
            }
            let b = *ids.next().expect("an id for each new block");
            blocks[k] = b;
            tick += 1;
            let new = BlockRow {
                position: self.start + k as u32,
                fill: self.fill,
                hash: hashes[k],
                indexed: table.insert(hashes[k], b),
                reads: new_reads,
                ..BlockRow::default()
            };
            rows[b as usize].renew(new, self.step, if read { read_tick } else { tick });
        }
        if read {
            reads_from + hashes.len() as u64
        } else {
            tick
        }
    }
}

/// Pops the `k` lowest-ranked blocks of a plain core's pool `pool` (its queue of every cached
/// block) onto `out`, then takes each out of the cache index and the prefix index: what
/// `Core::detach_block` does, less the cache-index counts and the counters, which the caller
/// updates once for all `k`; it checked that there are `k`.
#[inline(never)] // a call boundary: its &mut arguments do not alias
fn pop_evictable(
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
        |t| Core::entry_valid(rows, pool, t),
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

/// Drops one reference to each of `blocks`. A block that nothing references any more joins its
/// pool's cache index if it is indexed and cached (and the leaf queue too, prefix-aware, if it
/// is a leaf); one that is not indexed goes to `orphans`, for the caller to release unless
/// something else holds it (a pin, a move).
#[allow(clippy::too_many_arguments)]
#[inline(never)] // a call boundary: its &mut arguments do not alias
fn drop_refs(
    rows: &mut [BlockRow],
    links: &mut [Link],
    queues: &mut [PoolCache],
    ranking: Ranking<'_>,
    pools: PoolMap,
    prefix_aware: bool,
    blocks: &[u32],
    orphans: &mut Vec<u32>,
) {
    let Some(&first) = blocks.first() else {
        return;
    };
    // A sequence's blocks are mostly in one pool, the first block's: its queues take them
    // through one pusher each; blocks of other pools are queued one by one after.
    let home = rows[first as usize].loc;
    let p0 = pools.of(home.tier, home.level);
    let mut elsewhere = Vec::new();
    let mut pushed = 0;
    with_policy_key!(ranking, |key| {
        let PoolCache { cached, leaves, .. } = &mut queues[p0];
        let mut pusher = cached.pusher(blocks.len());
        let mut leaf_pusher = prefix_aware.then(|| leaves.pusher(blocks.len()));
        for &b in blocks {
            let row = &mut rows[b as usize];
            row.refcount -= 1;
            if row.refcount != 0 {
                continue; // still referenced: it was not cached and is not now
            }
            if !row.indexed {
                orphans.push(b);
                continue;
            }
            if !row.is_cached() {
                continue;
            }
            if (row.loc.tier, row.loc.level) != (home.tier, home.level) {
                elsewhere.push(b);
                continue;
            }
            let k = key(b as usize, row);
            row.version = row.version.wrapping_add(1);
            row.cached_in = p0 as u32;
            let ticket = Ticket {
                block: b,
                version: row.version,
            };
            pusher.push(k, ticket);
            if let Some(leaves) = leaf_pusher.as_mut().filter(|_| links[b as usize].is_leaf()) {
                leaves.push(ranking.evict_key(b as usize, row), ticket);
            }
            pushed += 1;
        }
    });
    queues[p0].pushed(rows, links, p0, pushed);
    for b in elsewhere {
        enqueue_if_cached(rows, links, queues, ranking, pools, prefix_aware, b);
    }
    for &b in blocks {
        settle_reclaimable(rows, links, queues, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TierConfig;

    /// Keys order their floats as `f64::total_cmp` does, and give them back unchanged.
    #[test]
    fn keys_order_floats_and_give_them_back() {
        let xs = [
            f64::NEG_INFINITY,
            -1e300,
            -1.0,
            -f64::MIN_POSITIVE / 4.0,
            -0.0,
            0.0,
            f64::MIN_POSITIVE / 4.0,
            0.5,
            1.0,
            1e300,
            f64::INFINITY,
        ];
        for (i, &a) in xs.iter().enumerate() {
            assert_eq!(Key::new(a, 0.0, 0).primary().to_bits(), a.to_bits());
            for &b in &xs[i + 1..] {
                assert!(Key::new(a, 0.0, 0) < Key::new(b, 0.0, 0), "{a} < {b}");
                assert!(
                    Key::new(0.0, a, 9) < Key::new(0.0, b, 0),
                    "{a} < {b} second"
                );
            }
        }
    }

    /// The replay's fused append-and-read leaves the core exactly as an append followed by
    /// `record_reads` of the same blocks: same blocks, read counts and access clock.
    #[test]
    fn append_with_read_equals_append_then_record_reads() {
        let cfg = Config {
            block_size: 4,
            level_bytes: vec![1],
            tiers: vec![TierConfig {
                tier: Tier::Device,
                budget_bytes: Some(24),
            }],
            policy: PolicyKind::Lfu, // ranks by reads, then recency: both show in the key
            evict_on_full: true,
            ..Config::default()
        };
        let (mut fused, mut apart) = (Core::new(cfg.clone()).unwrap(), Core::new(cfg).unwrap());
        let mut out = Appended::default();
        let mut x = 7u64;
        for request in 0..300 {
            // Prefix-chained hashes from a small alphabet: hits, misses and evictions.
            let n = 1 + (x >> 7) % 8;
            let hashes: Vec<u64> = (0..n).map(|k| (x >> 3) % 5 * 100 + k).collect();
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let (a, b) = (fused.add_sequence(), apart.add_sequence());
            let got = fused.append_blocks_into(a, &hashes, &mut out, true);
            match apart.append_blocks(b, &hashes) {
                Ok(want) => {
                    got.unwrap();
                    assert_eq!(out, want, "request {request}");
                    apart.record_reads(&want.blocks).unwrap();
                }
                Err(e) => assert_eq!(got.unwrap_err(), e, "request {request}"),
            }
            if request % 3 == 0 {
                for core in [&mut fused, &mut apart] {
                    let id = core.plan().unwrap().id; // a step of the decay clock
                    core.commit(id).unwrap();
                }
            }
            fused.free_sequence(a).unwrap();
            apart.free_sequence(b).unwrap();
            assert_eq!(fused.clock, apart.clock, "request {request}");
            for id in 0..apart.num_block_ids() as u32 {
                assert_eq!(fused.blocks.is_live(id), apart.blocks.is_live(id));
                if apart.blocks.is_live(id) {
                    assert_eq!(
                        fused.block_score(id).unwrap(),
                        apart.block_score(id).unwrap()
                    );
                    let (f, p) = (
                        &fused.blocks.rows[id as usize],
                        &apart.blocks.rows[id as usize],
                    );
                    assert_eq!((f.reads, f.reads_step), (p.reads, p.reads_step));
                }
            }
        }
        assert!(apart.counters().evictions > 0 && apart.counters().shared_hits > 0);
    }

    fn salted_core() -> Core {
        Core::new(Config {
            block_size: 16,
            level_bytes: vec![64],
            namespace: crate::prefix::namespace_seed("default"),
            ..Config::default()
        })
        .unwrap()
    }

    /// Hashes of `tokens` as the core indexed them (0 for a partial block).
    fn hashes_of(core: &Core, seq: u32) -> Vec<u64> {
        let blocks = core.sequence_blocks(seq).unwrap();
        blocks
            .iter()
            .map(|&b| core.block_hash(b).unwrap().unwrap_or(0))
            .collect()
    }

    /// Without a salt, the hashes are those of before salts existed, bit for bit (the values of
    /// `prefix_hashes(range(32), 16)` in the default namespace, pinned in tests/test_core_api.py
    /// before this change): keys persisted or published by earlier versions stay valid.
    #[test]
    fn an_unsalted_sequence_keeps_the_old_hashes() {
        const FIXED: [u64; 2] = [0x6061_3E95_F4B4_2118, 0xF132_5E8B_0BB9_ABE5];
        let tokens: Vec<u32> = (0..32).collect();
        let seed = crate::prefix::namespace_seed("default");
        assert_eq!(seed, 0x6C5B_964D_9473_AC1A);
        assert_eq!(crate::prefix::chain_seed(seed, None).unwrap(), seed);
        assert_eq!(crate::prefix::prefix_hashes(&tokens, 16, seed), FIXED);
        let mut c = salted_core();
        let (a, b) = (c.add_sequence(), c.add_sequence_salted(None).unwrap());
        c.append_tokens(a, &tokens).unwrap();
        let got = c.append_tokens(b, &tokens).unwrap();
        assert_eq!(hashes_of(&c, a), FIXED);
        assert_eq!(hashes_of(&c, b), FIXED);
        assert_eq!(got.shared, [true, true], "None is no salt: it shares");
        assert_eq!(c.lookup_tokens(&tokens), c.sequence_blocks(a).unwrap());
        assert_eq!(
            c.lookup_tokens_salted(&tokens, None).unwrap(),
            c.lookup_tokens(&tokens)
        );
    }

    /// Same tokens, different salts (or a salt and none): no block in common, and each lookup
    /// finds its own salt's blocks only. Same salt: shared as without salts.
    #[test]
    fn salts_share_blocks_within_a_salt_only() {
        let tokens: Vec<u32> = (100..140).collect(); // 2 full blocks and a partial one
        let mut c = salted_core();
        let plain = c.add_sequence();
        let a = c.add_sequence_salted(Some("tenant-a")).unwrap();
        let b = c.add_sequence_salted(Some("tenant-b")).unwrap();
        let mut got = Vec::new();
        for s in [plain, a, b] {
            // Split where a block boundary falls inside a call: the chain goes on from the salt.
            c.append_tokens(s, &tokens[..20]).unwrap();
            got.push(c.append_tokens(s, &tokens[20..]).unwrap());
        }
        assert!(got.iter().all(|g| g.shared.iter().all(|&x| !x)));
        let blocks: Vec<Vec<u32>> = [plain, a, b]
            .iter()
            .map(|&s| c.sequence_blocks(s).unwrap().to_vec())
            .collect();
        for i in 0..3 {
            for j in 0..i {
                assert!(blocks[i].iter().all(|x| !blocks[j].contains(x)));
            }
        }
        let seed = c.cfg.namespace;
        for (salt, seq) in [("tenant-a", a), ("tenant-b", b)] {
            let salted = crate::prefix::salted_seed(seed, salt);
            let want = crate::prefix::prefix_hashes(&tokens, 16, salted);
            assert_eq!(hashes_of(&c, seq)[..2], want[..]);
            let found = c.lookup_tokens_salted(&tokens, Some(salt)).unwrap();
            assert_eq!(found, blocks[if salt == "tenant-a" { 1 } else { 2 }][..2]);
        }
        assert_eq!(c.lookup_tokens(&tokens), blocks[0][..2]);
        assert!(c
            .lookup_tokens_salted(&tokens, Some("tenant-c"))
            .unwrap()
            .is_empty());
        // The same salt shares, and a fork keeps its parent's salt.
        let a2 = c.add_sequence_salted(Some("tenant-a")).unwrap();
        let again = c.append_tokens(a2, &tokens).unwrap();
        assert_eq!(again.shared, [true, true, false]);
        assert_eq!(again.blocks[..2], blocks[1][..2]);
        let child = c.fork(a2).unwrap().child;
        c.append_tokens(child, &(140..148).collect::<Vec<_>>())
            .unwrap();
        let longer: Vec<u32> = (100..148).collect();
        assert_eq!(
            c.lookup_tokens_salted(&longer, Some("tenant-a"))
                .unwrap()
                .len(),
            3
        );
        assert_eq!(c.lookup_tokens(&longer).len(), 2);
        // An empty salt is refused (None says "no salt").
        let err = c.add_sequence_salted(Some("")).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { what: "salt", .. }));
        assert!(c.lookup_tokens_salted(&tokens, Some("")).is_err());
    }

    /// A salted seed is never the hash of a block: its input is never a whole number of token
    /// ids long, so a salt spelling token ids does not open the unsalted chain of those ids.
    #[test]
    fn a_salted_seed_is_not_a_block_hash() {
        let seed = crate::prefix::namespace_seed("default");
        // "abcd" as one token id, little-endian; and salts of every length class mod 4.
        let token = u32::from_le_bytes(*b"abcd");
        assert_ne!(
            crate::prefix::salted_seed(seed, "abcd"),
            crate::prefix::chain_hash(seed, &[token])
        );
        let salts = [
            "a", "ab", "abc", "abcd", "abcde", "é", "tenant-a", "tenant-b",
        ];
        let seeds: Vec<u64> = salts
            .iter()
            .map(|s| crate::prefix::salted_seed(seed, s))
            .collect();
        for (i, x) in seeds.iter().enumerate() {
            assert!(!seeds[..i].contains(x));
            assert_ne!(*x, seed);
        }
        // Salted in another namespace: another seed.
        assert_ne!(
            crate::prefix::salted_seed(crate::prefix::namespace_seed("other"), "tenant-a"),
            seeds[6]
        );
    }
}
