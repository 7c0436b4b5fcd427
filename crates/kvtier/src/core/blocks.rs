//! The block table ([`Blocks`]): one hot row per block id ([`BlockRow`]), its lower-tier copy,
//! its place in the prefix tree ([`Link`], and [`attach`] / [`detach`], which keep the lists
//! of children), the free ids, and a bitmap of the live ones. Plain data: `Core` decides what
//! the fields mean together (see the invariants in `core`).

use crate::config::Tier;
use crate::stats::DecayTable;
use crate::types::{Loc, NO_BLOCK, NO_SLOT};

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
    /// Its conversation has ended: the last sequence to let go of it was released
    /// (`Core::release`), or `Core::release_cached` named it since. A cached leaf so marked is
    /// evicted before every other (see `Ranking::evict_key`). A read clears it, and so does a
    /// holder that was not released letting go last (sharing alone does not: a failed append
    /// that shared it changes nothing).
    pub(crate) released: bool,
    /// How often a sequence took its hash before, capped (see `frequency`): under
    /// `importance` on a prefix-aware core, what eviction ranks a cached leaf by first.
    pub(crate) class: u8,
}

// The hot row stays one cache line.
const _: () = assert!(std::mem::size_of::<BlockRow>() == 64);

pub(crate) const NOT_CACHED: u32 = u32::MAX;

impl BlockRow {
    /// Unreferenced, unpinned, not moving and holding a slot: cached, ready to be demoted,
    /// offloaded or (a leaf) evicted.
    #[inline(always)]
    pub(super) fn is_cached(&self) -> bool {
        self.live
            && self.refcount == 0
            && self.pins == 0
            && !self.moving
            && self.loc.slot != NO_SLOT
    }

    /// The row of a new block at the location this row holds, referenced once and touched at
    /// access clock `tick`; its content fields (position, fill, hash, indexed) from `new`.
    #[inline(always)]
    pub(super) fn renew(&mut self, new: BlockRow, step: u32, tick: u64) {
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

    /// One read at step `step` and access-clock value `tick`: the recency, and the decayed read
    /// count where the policy ranks by it (`counts`: the decay table). A block read again is no
    /// longer released: its conversation evidently goes on.
    #[inline(always)]
    pub(super) fn read(&mut self, counts: Option<&DecayTable>, step: u32, tick: u64) {
        if let Some(decay) = counts {
            self.reads = self.reads * decay.pow(step - self.reads_step) + 1.0;
            self.reads_step = step;
        }
        self.last_access = tick;
        self.released = false;
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
            released: false,
            class: 0,
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
    pub(super) next: u32,
    prev: u32,
    pub(super) blockers: u32,
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

/// Whether a leaf of the prefix tree is `b` or lies at most `below` links under it: `b` is one
/// of the last `below + 1` blocks of a chain through it.
pub(crate) fn near_leaf(links: &[Link], b: u32, below: u32) -> bool {
    let link = &links[b as usize];
    if link.is_leaf() {
        return true;
    }
    let mut c = if below > 0 {
        link.first_child
    } else {
        NO_BLOCK
    };
    while c != NO_BLOCK {
        if near_leaf(links, c, below - 1) {
            return true;
        }
        c = links[c as usize].next;
    }
    false
}

/// Links indexed block `b` (whose row is `rows[b]`; in no parent's list of children) under
/// `parent` (`NO_BLOCK`: a root), with whatever children it has. The caller settles the
/// parent's `reclaimable` and evictability.
#[inline(always)]
pub(super) fn attach(links: &mut [Link], rows: &[BlockRow], b: u32, parent: u32) {
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
pub(super) fn detach(links: &mut [Link], rows: &[BlockRow], b: u32) -> u32 {
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

/// All blocks, indexed by block id.
#[derive(Debug, Default, Clone)]
pub(crate) struct Blocks {
    pub(crate) rows: Vec<BlockRow>,
    /// A higher-precision copy kept in a lower tier (write-through), if any.
    pub(crate) copy: Vec<Option<Loc>>,
    /// Places in the prefix tree (prefix-aware cores).
    pub(crate) links: Vec<Link>,
    pub(super) free_ids: Vec<u32>,
    /// One bit per block id, set while live: batch calls validate ids against this compact
    /// copy (1M blocks in 128 KiB) instead of touching each block's row twice.
    live_bits: Vec<u64>,
}

impl Blocks {
    pub(super) fn with_capacity(n: usize) -> Blocks {
        Blocks {
            rows: Vec::with_capacity(n),
            copy: Vec::with_capacity(n),
            links: Vec::with_capacity(n),
            free_ids: Vec::new(),
            live_bits: Vec::with_capacity(n.div_ceil(64)),
        }
    }

    /// A new id's row (and its word of the live bitmap).
    pub(super) fn push_row(&mut self) -> u32 {
        let b = self.rows.len() as u32;
        self.rows.push(BlockRow::default());
        self.copy.push(None);
        self.links.push(Link::default());
        self.live_bits.resize(self.rows.len().div_ceil(64), 0);
        b
    }

    #[inline]
    pub(super) fn set_live(&mut self, b: u32, live: bool) {
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
