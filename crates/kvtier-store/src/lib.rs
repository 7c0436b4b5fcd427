//! kvtier's store engines, with no Python in them: what `kvtier.stores` keeps values with.
//!
//! - [`format`](mod@format) — the sealed value format (a versioned header, the payload, a
//!   checksum), its constants defined here once: values are sealed and checked with it, and
//!   Python reads the constants and the header encoder through the bindings
//!   (`kvtier._core.FORMAT_*`, `seal_header`);
//! - [`checksum`] — the stored-value checksum (CRC-64/NVME) and the digest that names things
//!   (xxh3-64);
//! - [`host`] — a host store's values in memory: a keyed map within a byte budget, checked on
//!   every read;
//! - [`files`] — a disk store's values as files: batches read and written on several threads,
//!   each value checksummed as it is read or written, written atomically;
//! - [`SharedIndex`] — the budget and eviction order both share: the core's
//!   [`kvtier::StoreIndex`] (the core's policies and eviction queue, so it stays in the core)
//!   behind a lock; [`StoreCounts`] — what a store did.
//!
//! `crates/kvtier-py` wraps these as `kvtier._core` (`HostValues`, `read_stored`,
//! `write_stored`, `unseal`, ...): it converts Python objects and errors, and releases the GIL.
//!
//! No `unsafe` but in one function, `files::read_more` (a read into a buffer's spare capacity,
//! which spares zeroing each value before it is read).
#![deny(unsafe_code)]

pub mod checksum;
mod error;
pub mod files;
pub mod format;
pub mod host;
mod index;
mod stats;

pub use crate::checksum::Checksum;
pub use crate::error::{Error, Refusal, Result};
pub use crate::index::SharedIndex;
pub use crate::stats::StoreCounts;
