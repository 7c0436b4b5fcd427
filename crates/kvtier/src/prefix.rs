//! Prefix hashing and the prefix index.
//!
//! A block's hash chains its parent's hash with its own token ids:
//! `h(i) = xxh3_64(token ids of block i as little-endian u32, seed = h(i-1))`, with
//! `h(-1) = namespace seed`. Equal hash ⇒ equal whole prefix, so a lookup walks a request's
//! hashes until the first one the index lacks. xxh3 is specified bit-for-bit, so hashes are
//! stable across processes, machines and runs (unlike Python's `hash`).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use twox_hash::XxHash3_64;

/// Seed of the hash chain for a namespace (model, codec, tenant...).
pub fn namespace_seed(namespace: &str) -> u64 {
    XxHash3_64::oneshot(namespace.as_bytes())
}

/// Hash of one block of token ids given its parent's hash.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    XxHash3_64::oneshot_with_seed(parent, &bytes)
}

/// Chained hashes of every full block of `tokens`; a trailing partial block has none.
pub fn prefix_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut parent = seed;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = chain_hash(parent, block);
            parent
        })
        .collect()
}

/// The index's keys are already uniformly distributed 64-bit hashes (or trace ids): one
/// multiply spreads them over the table; SipHash would only add cost.
#[derive(Default, Clone, Copy)]
pub struct PrehashedHasher(u64);

impl Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    }
}

pub(crate) type FastMap<V> = HashMap<u64, V, BuildHasherDefault<PrehashedHasher>>;

/// Hash → the block that holds that prefix. One block per hash: inserting a hash that is
/// already present shares the existing block instead of storing it twice.
#[derive(Debug, Default, Clone)]
pub struct PrefixIndex {
    map: FastMap<u32>,
}

impl PrefixIndex {
    pub fn get(&self, hash: u64) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Registers `block` under `hash` unless the hash is taken; returns whether it was.
    pub fn insert(&mut self, hash: u64, block: u32) -> bool {
        use std::collections::hash_map::Entry;
        match self.map.entry(hash) {
            Entry::Occupied(_) => false,
            Entry::Vacant(v) => {
                v.insert(block);
                true
            }
        }
    }

    /// Removes `hash` if it maps to `block`.
    pub fn remove(&mut self, hash: u64, block: u32) {
        use std::collections::hash_map::Entry;
        if let Entry::Occupied(e) = self.map.entry(hash) {
            if *e.get() == block {
                e.remove();
            }
        }
    }

    /// Number of leading hashes present, and their blocks.
    pub fn longest_prefix(&self, hashes: &[u64]) -> Vec<u32> {
        hashes.iter().map_while(|h| self.get(*h)).collect()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}
