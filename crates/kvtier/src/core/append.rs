//! Appends: full blocks by their hashes (a trace's), token ids (hashed here), or tokens without
//! ids (`extend`). Indexed blocks are shared, the rest are new level-0 device blocks, room made
//! first; a failed append changes nothing. New blocks about to be saved encoded may then be
//! placed below level 0 before anything is written (`place_saved`).

use crate::config::Tier;
use crate::error::{Error, Result};
use crate::prefix::chain_hash;

use super::blocks::BlockRow;
use super::passes::{share_indexed, NewBlocks};
use super::ranking::End;
use super::{Appended, Core};

/// A block `append_tokens` is about to add: its hash and the hash before it (a full block),
/// the indexed block it shares, and its tokens.
type PlannedBlock = (Option<(u64, u64)>, Option<u32>, usize);

impl Core {
    /// A new level-0 device block (see [`Core::new_device_id`]) holding `fill` tokens at
    /// `position` of its sequence; with `(hash, the hash before it)`, it is indexed under the
    /// hash unless another block has it (or, prefix-aware, no block has the one before).
    pub(super) fn new_device_block(
        &mut self,
        position: u32,
        fill: u32,
        hash: Option<(u64, u64)>,
    ) -> u32 {
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

    /// Counts a sighting of each hashed block a sequence just took, new or shared, at tick
    /// `now` (see `frequency`): its class. Under `importance`, prefix-aware, only.
    fn see_blocks(&mut self, blocks: &[u32], now: u64) {
        if !self.ranking().adaptive() {
            return;
        }
        for &b in blocks {
            let row = &mut self.blocks.rows[b as usize];
            if row.hash != 0 {
                row.class = self.freq.seen(row.hash, now);
            }
        }
    }

    fn share(&mut self, b: u32) {
        self.blocks.rows[b as usize].refcount += 1;
        self.counters.shared_hits += 1;
        self.refresh_evictable(b); // referenced: not cached
    }

    fn unshare(&mut self, b: u32) {
        self.blocks.rows[b as usize].refcount -= 1;
        self.counters.shared_hits -= 1;
        self.refresh_evictable(b);
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
        // Sighted as of the allocations, before the reads: as an append without them would be.
        self.see_blocks(&out.blocks, fresh.clock + missing);
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
        self.see_blocks(&out.blocks, self.clock);
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

    /// Places new blocks that are about to be written straight into a prefix cache (a
    /// connector's save: its sequence lets go of them at once, so no recent window keeps them)
    /// where a cached block of theirs would settle, before any byte of them is written. With
    /// `settle_cached`, each goes to the level it settles at (see
    /// [`super::ranking::End::home`]: the chain's ends to the ends' level, any other block to
    /// the bottom) where that level has a free slot, else to the
    /// most precise level below 0 that has one; without, the chain's ends (see
    /// [`super::ranking::End`]) stay at level 0 and every other block goes to the most precise
    /// level below 0 with a free slot. A block no slot is left for stays at level 0. Each must
    /// be a level-0 device block just allocated: live, pinned, held by one sequence, not moving,
    /// with no lower-tier copy. Returns the level of each block; a call that fails changes
    /// nothing.
    pub fn place_saved(&mut self, ids: &[u32]) -> Result<Vec<u8>> {
        self.check_blocks(ids)?;
        for &b in ids {
            let row = &self.blocks.rows[b as usize];
            let fresh = row.loc.tier == Tier::Device
                && row.loc.level == 0
                && row.loc.slot != crate::types::NO_SLOT
                && row.pins > 0
                && row.refcount == 1
                && !row.moving
                && self.blocks.copy[b as usize].is_none();
            if !fresh {
                return Err(Error::InvalidArgument {
                    what: "place_saved",
                    reason: format!(
                        "block {b} is not a new level-0 device block (pinned, held by one \
                         sequence, no copy): only those have no bytes yet"
                    ),
                });
            }
        }
        let (last, ends) = (self.cfg.last_kept_level(), self.cfg.resolved_ends_level());
        let mut levels = Vec::with_capacity(ids.len());
        for &b in ids {
            let row = self.blocks.rows[b as usize];
            let end = self.ranking().end(&row, &self.blocks.links, b);
            let wanted = match (self.cfg.settle_cached, end) {
                (true, end) => end.home(ends, last),
                (false, End::None) => 1,
                (false, _) => 0,
            };
            let mut at = row.loc;
            if wanted > 0 && last > 0 {
                let mut levels = std::iter::once(wanted).chain(1..=last);
                if let Some(loc) = levels.find_map(|l| self.take_slot(Tier::Device, l)) {
                    self.give_slot(row.loc);
                    at = loc;
                }
            }
            self.blocks.rows[b as usize].loc = at;
            levels.push(at.level);
        }
        Ok(levels)
    }
}
