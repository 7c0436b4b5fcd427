//! The hot passes of an append and of a sequence's release over many blocks, taking the core's
//! parts apart (rows, links, queues, the prefix index) so that a loop holds them at once and
//! their `&mut`s do not alias: the lookup that shares indexed blocks ([`share_indexed`]), the
//! fill-in of new blocks ([`NewBlocks::fill_in`]), and dropping references ([`drop_refs`]).

use crate::config::PolicyKind;
use crate::evict::Ticket;
use crate::prefix::PrefixIndex;
use crate::stats::DecayTable;
use crate::types::NO_SLOT;

use super::blocks::{BlockRow, Link};
use super::cache::{enqueue_if_cached, push_leaf, settle_reclaimable, PoolCache};
use super::ranking::{with_policy_key, End, PoolMap, Ranking};
use super::Appended;

/// The lookup pass of an append: each hash's indexed block, referenced at once (shared) so that
/// making room for the others cannot evict it, else `NO_SLOT`, onto `out` (which says which it
/// shared). Returns how many are missing. The caller counts the shared hits.
#[inline(never)] // a call boundary: its &mut arguments do not alias
pub(super) fn share_indexed(
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
pub(super) struct NewBlocks<'a> {
    pub(super) ids: &'a [u32],
    pub(super) start: u32,
    pub(super) fill: u32,
    pub(super) step: u32,
    pub(super) clock: u64,
}

impl NewBlocks<'_> {
    /// Gives each `NO_SLOT` of `out.blocks` (hash `hashes[k]`) the next new id, indexes it
    /// and writes its row, touched at the next tick of the access clock. With `read`, then
    /// reads every appended block in order, as `record_reads` of them would (a new block is
    /// written as read once), counting reads with `counts` (see [`DecayTable::if_counted`]).
    /// Returns the access clock after it all.
    #[inline(never)] // a call boundary: its &mut arguments do not alias
    pub(super) fn fill_in(
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

/// Drops one reference to each of `blocks`, those of a sequence that was `released` or not. A
/// block that nothing references any more is released as its last holder was; it joins its
/// pool's cache index if it is indexed and cached (and the leaf queue too, prefix-aware, if it
/// is a leaf); one that is not indexed goes to `orphans`, for the caller to release unless
/// something else holds it (a pin, a move).
#[allow(clippy::too_many_arguments)]
#[inline(never)] // a call boundary: its &mut arguments do not alias
pub(super) fn drop_refs(
    rows: &mut [BlockRow],
    links: &mut [Link],
    queues: &mut [PoolCache],
    ranking: Ranking<'_>,
    pools: PoolMap,
    prefix_aware: bool,
    blocks: &[u32],
    released: bool,
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
        let PoolCache {
            ranked,
            leaves,
            young,
            ..
        } = &mut queues[p0];
        let [others, ends @ ..] = ranked;
        let mut pusher = others.pusher(blocks.len());
        let adaptive = ranking.adaptive();
        for &b in blocks {
            let row = &mut rows[b as usize];
            row.refcount -= 1;
            if row.refcount != 0 {
                continue; // still referenced: it was not cached and is not now
            }
            row.released = released;
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
            match ranking.end(row, links, b) {
                End::None => pusher.push(k, ticket),
                // A few a sequence: one pusher each is cheap.
                end => ends[end as usize - 1].push(k, ticket),
            }
            if prefix_aware && links[b as usize].is_leaf() {
                let key = ranking.evict_key(b as usize, row);
                push_leaf(leaves, young, row, key, ticket, adaptive);
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
