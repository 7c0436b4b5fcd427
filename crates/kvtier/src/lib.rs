//! kvtier core: the decisions of a tiered, mixed-precision KV-cache manager, with no tensors in
//! it. Python owns the bytes; this crate owns block ids, slots, statistics and plans.
//!
//! - [`Core`] — block table, sequences, slot pools, prefix index, statistics ([`core`]);
//! - [`Plan`] — the scheduler's moves, two-phase ([`scheduler`]);
//! - [`sim`] — replays a request trace through a real `Core`;
//! - [`StoreIndex`] — what a host or disk store evicts, under the same policies.
#![forbid(unsafe_code)]

pub mod config;
pub mod core;
pub mod error;
mod evict;
pub mod pool;
pub mod prefix;
pub mod scheduler;
pub mod sim;
pub mod stats;
pub mod store_index;
mod types;

pub use crate::config::{Config, PolicyKind, Tier, TierConfig};
pub use crate::core::{Appended, Core, Counters, Forked, IndexChange, PoolUsage};
pub use crate::error::{Error, Result};
pub use crate::prefix::{
    chain_hash, chain_seed, namespace_seed, prefix_hashes, salted_seed, PrefixIndex,
};
pub use crate::scheduler::{Move, MoveKind, Plan};
pub use crate::store_index::StoreIndex;
pub use crate::types::{Key, Loc, NO_SLOT};
