//! kvtier's CPU data path for an engine's paged KV cache (vLLM's, on the CPU; its CPU
//! offloading tier's chunks): whole blocks between a paged cache, in the layout its attention
//! backend packs them, and kvtier's block form `[2, H, N, D]` (K then V, token-major per head),
//! one pass over the bytes; the same blocks checked finite and measured (each token's key
//! norm) where they lie; one token's K/V checked and written into a pool row. No PyO3: the
//! extension (`crates/kvtier-py`) binds these to Python, which keeps the tensors alive and
//! passes their addresses.
//!
//! A block of the cache holds, per head `h` and token `n` of its `N` tokens ([`Layout`]):
//!
//! - `channels`: K at `[h, n, 0..D]`, V at `[h, n, D..2D]` (heads and tokens strided: the CUDA
//!   attention backends, and vLLM's CPU offloading tier holding their pages);
//! - `cpu-vec`: per head a region of K column-major `[D, N]`, then one of V row-major `[N, D]`;
//! - `cpu-amx`: per head K in tiles `[N/16, D/2, 16, 2]` (16 tokens a tile, channel pairs as
//!   32-bit words), then V in tiles `[D/16, N/2, 16, 2]` (16 channels a tile, token pairs).
//!
//! Element types are named by the kernels' dtype code: 0 fp32, 1 fp16, 2 bf16.
//!
//! # Safety
//! The entry points take raw addresses (the caller's tensors): each is `unsafe` and says what
//! memory it reads and writes. Their arguments are checked ([`Blocks::new`],
//! [`element_bytes`]) before any byte is touched.

mod elements;
mod layout;

pub use elements::{blocks_key_norms, element_bytes, write_token};
pub use layout::{copy_rows, Blocks, Geometry, Layout};

/// The crate's one error type: an argument the kernels cannot take. Nothing was read or
/// written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

/// A refusal of K or V: a NaN, an infinity or a value of magnitude past the caller's limit in
/// the keys (`Key`) or the values (`Value`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beyond {
    Key = 1,
    Value = 2,
}
