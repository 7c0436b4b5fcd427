//! The prefix tree (`Config::prefix_aware`): which blocks are indexed under which hash, and
//! under which parent; a block leaves the index with its descendants, and a leaf planned for
//! eviction is parked out of the tree until its plan commits or aborts.

use crate::types::NO_BLOCK;

use super::blocks::{attach, detach, NOT_CACHED};
use super::{Appended, Core};

impl Core {
    /// Whether blocks form prefix trees (`Config::prefix_aware`).
    #[inline(always)]
    pub(crate) fn prefix_aware(&self) -> bool {
        self.cfg.prefix_aware
    }

    /// The parent a block at `position` whose hash chains on from `prev` takes in the prefix
    /// tree: `NO_BLOCK` for a root (position 0, or a plain core), the block indexed under `prev`
    /// otherwise. `None`: none is, and the block must not be indexed (it would be stranded).
    #[inline(always)]
    pub(super) fn parent_for(&self, position: u32, prev: u64) -> Option<u32> {
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
                self.child_added(parent);
            }
        }
        true
    }

    /// Settles `parent` after it gained a child: a cached one is queued again (it is no
    /// chain's leaf any more, see `ranking::End`); any has its reclaimable flag brought up to
    /// date.
    #[inline(always)]
    fn child_added(&mut self, parent: u32) {
        if self.blocks.rows[parent as usize].cached_in != NOT_CACHED {
            self.refresh_evictable(parent);
        } else {
            self.settle_block(parent);
        }
        self.ends_moved(parent);
    }

    /// After the children of `parent` changed, with `keep_leaves` above 1: its ancestors
    /// fewer than `keep_leaves` links above it may have become, or stopped being, one of their
    /// chain's last blocks (see `ranking::End`); the cached ones are queued again.
    #[inline(always)]
    fn ends_moved(&mut self, parent: u32) {
        let mut a = parent;
        for _ in 1..self.cfg.keep_leaves {
            a = self.blocks.links[a as usize].parent;
            if a == NO_BLOCK {
                return;
            }
            self.refresh_evictable_if_indexed(a);
        }
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
        self.log_left(hash);
        if self.prefix_aware() {
            let parent = detach(&mut self.blocks.links, &self.blocks.rows, b);
            if parent != NO_BLOCK {
                self.refresh_evictable(parent); // a leaf now, perhaps
                self.ends_moved(parent);
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
        self.ends_moved(parent);
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
            self.ends_moved(parent);
        }
    }

    /// Puts the new blocks an append indexed (`fill_in`) into the prefix tree, each under the
    /// block indexed before it (`prev`: the hash before the first); one whose parent is not
    /// indexed leaves the index again (it would be stranded), and so do the blocks after it.
    /// A parent must be older than the append or linked before it in this one: hashes that
    /// repeat (a trace's, a caller's) could otherwise make a block its own ancestor.
    #[inline(never)]
    pub(super) fn link_new_blocks(
        &mut self,
        start: u32,
        prev: u64,
        hashes: &[u64],
        out: &Appended,
    ) {
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
                        self.child_added(parent);
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
}
