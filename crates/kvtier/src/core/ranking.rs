//! A block's ranking key under the core's policy ([`Ranking`]), computed from its row and its
//! statistics, and [`with_policy_key!`], which names the policy as a constant in a loop over
//! many blocks; [`PoolMap`], a pool's index from a (tier, level) in registers.

use crate::config::{Config, PolicyKind, Tier};
use crate::stats::{BlockStats, DecayTable};
use crate::types::Key;

use super::blocks::{near_leaf, BlockRow, Link};

/// The ends of a cached chain, which demotion and offload take after every other cached block
/// of their pool, the sinks last: a saved prefix keeps its attention sink and the blocks the
/// next turn continues from (its recent window) at the higher precision longest, as a live
/// sequence keeps them at level 0. Eviction ranks them as any other leaf. The order of the
/// variants is the order demotion takes them in; each is the index of its queue in a pool
/// (see `cache::PoolCache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum End {
    /// Not an end.
    None = 0,
    /// One of the chain's last `keep_leaves` blocks: a leaf of the prefix tree, or a block
    /// with one fewer than `keep_leaves` blocks between it and a leaf below it.
    Leaf = 1,
    /// One of the chain's first `sink_blocks`.
    Sink = 2,
}

impl End {
    pub(crate) const ALL: [End; 3] = [End::None, End::Leaf, End::Sink];

    /// The level a cached block of this kind settles at (`settle_cached`): a chain's ends at
    /// `ends` (`Config::resolved_ends_level`), any other block at the bottom, `last_kept`.
    #[inline(always)]
    pub(crate) fn home(self, ends: u8, last_kept: u8) -> u8 {
        match self {
            End::Sink | End::Leaf => ends,
            End::None => last_kept,
        }
    }
}

/// What a block's ranking key is computed from besides its row, borrowed apart from the rows
/// and the eviction queues, so that a loop can hold all three at once (and a queue can ask for
/// keys while it changes).
#[derive(Clone, Copy)]
pub(crate) struct Ranking<'a> {
    pub(super) cfg: &'a Config,
    pub(super) decay: &'a DecayTable,
    pub(super) stats: &'a [BlockStats],
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
    pub(super) fn key_as(&self, policy: PolicyKind, b: usize, row: &BlockRow) -> Key {
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

    /// Which end of its chain cached block `b` (whose row is `row`) is, if any (see [`End`]):
    /// one of the first `sink_blocks` of its prefix, else one of its chain's last
    /// `keep_leaves` blocks in the prefix tree `links`. Prefix-aware cores only: a plain core
    /// ranks its cached blocks as independent ones, in one queue for every move.
    #[inline(always)]
    pub(crate) fn end(&self, row: &BlockRow, links: &[Link], b: u32) -> End {
        let leaves = self.cfg.keep_leaves;
        if !self.cfg.prefix_aware {
            End::None
        } else if row.position < self.cfg.sink_blocks {
            End::Sink
        } else if leaves > 0 && row.indexed && near_leaf(links, b, leaves - 1) {
            End::Leaf
        } else {
            End::None
        }
    }

    /// The key eviction queues a cached leaf under (prefix-aware cores): [`Ranking::key`], but
    /// under `importance` its class, then its last access (`frequency` says why; eviction then
    /// ranks the front of each class's queue by `Frequency::rank`). Eviction decides whether a
    /// block will be loaded again, which how often its prefix came back tells; how much
    /// attention needs its precision, which importance tells, decides its level (`key`:
    /// demotion and offload order). A released block (its client said its conversation ended)
    /// will not be loaded again: it ranks below every block that is not, the least recently
    /// used first.
    #[inline(always)]
    pub(crate) fn evict_key(&self, b: usize, row: &BlockRow) -> Key {
        if row.released {
            return Key::first(row.last_access);
        }
        match self.cfg.policy {
            PolicyKind::Importance => Key::new(f64::from(row.class), 0.0, row.last_access),
            _ => self.key(b, row),
        }
    }

    /// Whether eviction adapts to measured reuse (see `frequency`): `importance` on a
    /// prefix-aware core.
    #[inline(always)]
    pub(crate) fn adaptive(&self) -> bool {
        self.cfg.prefix_aware && self.cfg.policy == PolicyKind::Importance
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
pub(super) use with_policy_key;

/// The pool of a (tier, level): its index in `Core::pools` and `Core::caches`, copied out
/// of the core so that a loop over blocks computes it from registers.
#[derive(Clone, Copy)]
pub(crate) struct PoolMap {
    /// Position of each tier in the config (`usize::MAX` if absent), by `Tier as usize`.
    pub(super) tier_at: [usize; 4],
    pub(super) levels: usize,
}

impl PoolMap {
    #[inline(always)]
    pub(super) fn of(self, tier: Tier, level: u8) -> usize {
        let pos = self.tier_at[tier as usize];
        debug_assert!(pos != usize::MAX, "tier validated against the config");
        pos * self.levels + usize::from(level)
    }
}
