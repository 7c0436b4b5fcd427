//! The index log: what happened to indexed blocks, for an engine that tells others what its
//! tiers hold (vLLM's KV events: a router keys blocks by their hash and the medium they lie on).
//!
//! Off until [`Core::set_index_log`] turns it on (then it costs a push per change); the engine
//! drains it with [`Core::take_index_log`], in the order the changes happened. Two kinds of
//! entry, by hash: a block left the prefix index (evicted, dropped, forgotten, or a descendant
//! of one: no prompt can load it any more), or an indexed block now lies in another tier (a
//! plan moved it, or an aborted plan gave an evicted block its place back). Blocks entering the
//! index are not logged: the engine that writes them knows, and announces them once written.

use crate::config::Tier;

use super::Core;

/// One change to the prefix index: the block indexed under `hash` left it (`tier: None`), or
/// lies in `tier` now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexChange {
    pub hash: u64,
    pub tier: Option<Tier>,
}

impl Core {
    /// Starts (or stops, dropping what it holds) logging changes to the prefix index.
    pub fn set_index_log(&mut self, on: bool) {
        match (on, &self.index_log) {
            (true, None) => self.index_log = Some(Vec::new()),
            (false, _) => self.index_log = None,
            (true, Some(_)) => {}
        }
    }

    /// Whether changes to the prefix index are logged.
    pub fn index_log_on(&self) -> bool {
        self.index_log.is_some()
    }

    /// The changes logged since the last call, oldest first (empty while the log is off).
    pub fn take_index_log(&mut self) -> Vec<IndexChange> {
        match &mut self.index_log {
            Some(log) => std::mem::take(log),
            None => Vec::new(),
        }
    }

    /// Logs that the block indexed under `hash` left the index.
    #[inline(always)]
    pub(crate) fn log_left(&mut self, hash: u64) {
        if let Some(log) = &mut self.index_log {
            log.push(IndexChange { hash, tier: None });
        }
    }

    /// Logs that the indexed block under `hash` lies in `tier` now.
    #[inline(always)]
    pub(crate) fn log_moved(&mut self, hash: u64, tier: Tier) {
        if let Some(log) = &mut self.index_log {
            log.push(IndexChange {
                hash,
                tier: Some(tier),
            });
        }
    }
}
