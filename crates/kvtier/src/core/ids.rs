//! Block ids: handed out (a free id, or a new row), initialised for a new block, and released
//! with everything a block holds (its cache- and prefix-index entries, its slot, its copy).

use crate::error::{Error, Result};
use crate::stats::BlockStats;

use super::blocks::BlockRow;
use super::Core;

impl Core {
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
    pub(super) fn new_block_id(&mut self) -> u32 {
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
    pub(super) fn init_block(&mut self, b: u32, new: BlockRow) {
        self.clock += 1;
        self.blocks.rows[b as usize].renew(new, self.step, self.clock);
        self.reset_stats(&[b]);
        self.counters.allocated += 1;
    }

    /// The statistics of block ids taken by new blocks.
    #[inline(always)]
    pub(super) fn reset_stats(&mut self, ids: &[u32]) {
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
    pub(super) fn release_copy(&mut self, b: u32) {
        // Copies live in a lower tier: with one tier there are none to look up.
        if self.cfg.tiers.len() > 1 {
            if let Some(copy) = self.blocks.copy[b as usize].take() {
                self.give_slot(copy);
            }
        }
    }

    #[inline]
    pub(super) fn free_id_and_slot(&mut self, b: u32) {
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
}
