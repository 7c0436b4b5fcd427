//! Read-only views of blocks and pools, for the bindings and the tests.

use crate::config::Tier;
use crate::error::Result;

use crate::types::{Key, Loc, NO_BLOCK};

use super::Core;

impl Core {
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

    /// Every block in the prefix index (cached or in a live sequence), in id order: what a
    /// reset forgets.
    pub fn indexed_blocks(&self) -> Vec<u32> {
        let rows = &self.blocks.rows;
        (0..rows.len() as u32)
            .filter(|&b| rows[b as usize].live && rows[b as usize].indexed)
            .collect()
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

    /// Whether a block is released (see [`Core::release`]): cached, a prefix-aware core
    /// evicts it before every block that is not.
    pub fn block_released(&self, b: u32) -> Result<bool> {
        self.check_blocks(&[b])?;
        Ok(self.blocks.rows[b as usize].released)
    }

    /// Whether allocations may evict cached blocks (`Config::evict_on_full`). An engine that
    /// lets a plan demote and offload first allows it only for its retry.
    pub fn set_evict_on_full(&mut self, on: bool) {
        self.cfg.evict_on_full = on;
    }
}
