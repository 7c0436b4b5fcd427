//! Sequences: added (salted or not), forked, freed (their blocks cached, or freed with them), and
//! prefix lookups; blocks forgotten out of the prefix index; conversations a client ends
//! (`release` of a live sequence, `release_cached` of a freed chain), whose blocks eviction
//! takes first.

use crate::config::PolicyKind;
use crate::error::{Error, Result};

use super::blocks::NOT_CACHED;
use super::passes::drop_refs;
use super::ranking::Ranking;
use super::{Core, Forked, Sequence};

impl Core {
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

    pub(super) fn seq(&self, seq: u32) -> Result<&Sequence> {
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
        child.released = false; // it goes on with the conversation
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
            s.released,
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

    /// Says that the conversation of live sequence `seq` has ended: nothing will read its
    /// blocks again. When it is freed, each block it is the last to hold is *released*: a
    /// prefix-aware core evicts a released cached leaf before every block that is not (leaves
    /// only still: a released chain goes leaf first, and a block another sequence still holds
    /// stays until that one lets go, released then only if that one was too). A released block
    /// read again is not released any more, nor one shared again once its new holder lets go
    /// unreleased (while held it is never evicted). Demotion and offload order is unchanged
    /// (importance decides precision), and a plain core (`prefix_aware` off, whose cached
    /// blocks are ranked in one queue for every move) ranks them by the policy alone.
    pub fn release(&mut self, seq: u32) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        s.released = true;
        Ok(())
    }

    /// [`Core::release`] for a chain already cached, its sequence freed: releases the blocks of
    /// the longest indexed prefix of `hashes` and returns how many there are. A block a live
    /// sequence holds is released or not as that sequence is when it lets go.
    pub fn release_cached(&mut self, hashes: &[u64]) -> usize {
        let blocks = self.index.longest_prefix(hashes);
        self.release_blocks(&blocks)
    }

    /// [`Core::release_cached`] of a token sequence (full blocks only).
    pub fn release_cached_tokens(&mut self, tokens: &[u32]) -> usize {
        let blocks = self.lookup_tokens(tokens);
        self.release_blocks(&blocks)
    }

    /// [`Core::release_cached_tokens`] for a sequence salted with `salt` (see
    /// [`Core::add_sequence_salted`]): only blocks of sequences with the same salt match.
    pub fn release_cached_tokens_salted(
        &mut self,
        tokens: &[u32],
        salt: Option<&str>,
    ) -> Result<usize> {
        let blocks = self.lookup_tokens_salted(tokens, salt)?;
        Ok(self.release_blocks(&blocks))
    }

    /// Marks indexed blocks released; a cached one takes its new eviction key.
    fn release_blocks(&mut self, blocks: &[u32]) -> usize {
        for &b in blocks {
            let row = &mut self.blocks.rows[b as usize];
            if !row.released {
                row.released = true;
                if row.cached_in != NOT_CACHED {
                    self.refresh_evictable(b);
                }
            }
        }
        blocks.len()
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
}
