//! Prefix hashing and the prefix index.
//!
//! A block's hash chains its parent's hash with its own token ids:
//! `h(i) = xxh3_64(token ids of block i as little-endian u32, seed = h(i-1))`, with
//! `h(-1) = namespace seed`, or for a salted sequence (a tenant, vLLM's `cache_salt`) the
//! [`salted_seed`] of the namespace seed and the salt. Equal hash ⇒ equal whole prefix, so a lookup walks a request's
//! hashes until the first one the index lacks. xxh3 is specified bit-for-bit, so hashes are
//! stable across processes, machines and runs (unlike Python's `hash`).

use twox_hash::XxHash3_64;

/// Seed of the hash chain for a namespace (model, codec, tenant...).
pub fn namespace_seed(namespace: &str) -> u64 {
    XxHash3_64::oneshot(namespace.as_bytes())
}

/// Seed of the hash chain of a sequence salted with `salt` (a tenant id, vLLM's per-request
/// `cache_salt`...) in the namespace of `namespace_seed`: sequences with the same tokens and
/// different salts (or one salted, one not) never share a hash, so never a block.
///
/// `xxh3_64(salt as UTF-8, then one or two 0xFF bytes, seed = namespace_seed)`. UTF-8 never
/// holds a 0xFF byte, so distinct salts hash distinct inputs; and the input's length is never a
/// multiple of 4 while a block's (u32 token ids) always is, so a salted seed is never the hash
/// of a block of any chain (a sequence starting with tokens that spell the salt, say) except by
/// a 64-bit collision. xxh3 is not a cryptographic hash: salts keep honest tenants apart, they do
/// not stop one who crafts collisions on purpose.
pub fn salted_seed(namespace_seed: u64, salt: &str) -> u64 {
    let mut bytes = Vec::with_capacity(salt.len() + 2);
    bytes.extend_from_slice(salt.as_bytes());
    bytes.push(0xFF);
    if bytes.len() % 4 == 0 {
        bytes.push(0xFF);
    }
    XxHash3_64::oneshot_with_seed(namespace_seed, &bytes)
}

/// Seed of a sequence's hash chain: the namespace seed without a salt (the hashes of unsalted
/// sequences never change), its [`salted_seed`] with one. An empty salt is refused: say `None`.
pub fn chain_seed(namespace_seed: u64, salt: Option<&str>) -> crate::Result<u64> {
    match salt {
        None => Ok(namespace_seed),
        Some("") => Err(crate::Error::InvalidArgument {
            what: "salt",
            reason: "expected a non-empty str, or None for no salt; got an empty one".into(),
        }),
        Some(salt) => Ok(salted_seed(namespace_seed, salt)),
    }
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

/// Hash → the block that holds that prefix. One block per hash: inserting a hash that is
/// already present shares the existing block instead of storing it twice.
///
/// Every block reference of a request costs a lookup here, and every new or evicted block an
/// insert or a removal, so this is a plain open-addressing table tuned for that: keys are
/// already well mixed 64-bit hashes (or small trace ids, which one Fibonacci multiply spreads),
/// a slot is the key and its block in 16 bytes, probing is linear (the next slot is in the
/// same cache line) and at most half the slots are full, so a miss ends within a slot or two.
/// Removal shifts the rest of the run back, so there are no tombstones to clean up.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    slots: Vec<Slot>,
    len: usize,
    /// `64 - log2(slots.len())`: the home slot is the top bits of the multiplied key.
    shift: u32,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    hash: u64,
    block: u32,
}

/// Block id of an empty slot (no block has this id: ids stay below the number of blocks).
const EMPTY: u32 = u32::MAX;
const EMPTY_SLOT: Slot = Slot {
    hash: 0,
    block: EMPTY,
};
const MIN_SLOTS: usize = 16;

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::with_capacity(0)
    }
}

impl PrefixIndex {
    /// An index that holds `n` hashes before it first grows.
    pub fn with_capacity(n: usize) -> Self {
        let slots = (2 * n).next_power_of_two().max(MIN_SLOTS);
        PrefixIndex {
            slots: vec![EMPTY_SLOT; slots],
            len: 0,
            shift: 64 - slots.trailing_zeros(),
        }
    }

    /// The table for a run of operations with room for `n` more hashes (it grows first if
    /// need be). Its shape and count are then locals: a loop that writes slots does not load
    /// them again from the index after every write, as it would through `&mut self`.
    #[inline(always)]
    pub fn table(&mut self, n: usize) -> Table<'_> {
        if 2 * (self.len + n) > self.slots.len() {
            self.grow(self.len + n);
        }
        Table {
            mask: self.slots.len() - 1,
            shift: self.shift,
            len: self.len,
            slots: &mut self.slots,
            len_out: &mut self.len,
        }
    }

    #[inline]
    pub fn get(&self, hash: u64) -> Option<u32> {
        let (mask, shift) = (self.slots.len() - 1, self.shift);
        let (_, s) = find(&self.slots, mask, shift, hash);
        (s.block != EMPTY).then_some(s.block)
    }

    /// Registers `block` under `hash` unless the hash is taken; returns whether it was.
    #[inline(always)]
    pub fn insert(&mut self, hash: u64, block: u32) -> bool {
        self.table(1).insert(hash, block)
    }

    /// Removes `hash` if it maps to `block`.
    #[inline(always)]
    pub fn remove(&mut self, hash: u64, block: u32) {
        self.table(0).remove(hash, block);
    }

    /// Doubles the slots until `n` hashes take at most half of them.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, n: usize) {
        let size = (2 * n).next_power_of_two().max(2 * self.slots.len());
        let old = std::mem::replace(&mut self.slots, vec![EMPTY_SLOT; size]);
        self.shift = 64 - size.trailing_zeros();
        let (mask, shift) = (size - 1, self.shift);
        for s in old.into_iter().filter(|s| s.block != EMPTY) {
            let (i, _) = find(&self.slots, mask, shift, s.hash);
            self.slots[i] = s;
        }
    }

    /// Number of leading hashes present, and their blocks.
    pub fn longest_prefix(&self, hashes: &[u64]) -> Vec<u32> {
        hashes.iter().map_while(|h| self.get(*h)).collect()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
/// The slot a hash probes first: the top bits of its Fibonacci product.
#[inline(always)]
fn home(shift: u32, hash: u64) -> usize {
    (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize
}

/// The slot holding `hash`, or the empty slot where it would go, and its position.
#[inline(always)]
fn find(slots: &[Slot], mask: usize, shift: u32, hash: u64) -> (usize, Slot) {
    let mut i = home(shift, hash);
    loop {
        let s = slots[i];
        if s.block == EMPTY || s.hash == hash {
            return (i, s);
        }
        i = (i + 1) & mask;
    }
}

/// The index's slots with their shape and count in locals, for a run of operations: made by
/// [`PrefixIndex::table`] with room for the inserts it will take; the count goes back to the
/// index when it is dropped.
pub struct Table<'a> {
    slots: &'a mut [Slot],
    mask: usize,
    shift: u32,
    len: usize,
    len_out: &'a mut usize,
}

impl Table<'_> {
    /// [`PrefixIndex::insert`]; at most as many new hashes as the table was made for.
    #[inline(always)]
    pub fn insert(&mut self, hash: u64, block: u32) -> bool {
        assert!(block != EMPTY, "block id {block} is reserved");
        debug_assert!(2 * (self.len + 1) <= self.slots.len(), "no room was made");
        let (i, s) = find(self.slots, self.mask, self.shift, hash);
        if s.block != EMPTY {
            return false;
        }
        self.slots[i] = Slot { hash, block };
        self.len += 1;
        true
    }

    /// [`PrefixIndex::remove`].
    #[inline(always)]
    pub fn remove(&mut self, hash: u64, block: u32) {
        let (mut hole, s) = find(self.slots, self.mask, self.shift, hash);
        if s.block != block || block == EMPTY {
            return;
        }
        self.len -= 1;
        // Backward shift: move each later entry of the run into the hole unless its home lies
        // cyclically after the hole (it would then sit before its home, where no probe looks).
        let mut i = hole;
        loop {
            i = (i + 1) & self.mask;
            let s = self.slots[i];
            if s.block == EMPTY {
                break;
            }
            let home = home(self.shift, s.hash);
            if (i.wrapping_sub(home) & self.mask) >= (i.wrapping_sub(hole) & self.mask) {
                self.slots[hole] = s;
                hole = i;
            }
        }
        self.slots[hole] = EMPTY_SLOT;
    }
}

impl Drop for Table<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        *self.len_out = self.len;
    }
}
