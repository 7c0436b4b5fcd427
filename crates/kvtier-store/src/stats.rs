//! [`StoreCounts`]: what a store did, counted without a lock. Every store counts a batch in one
//! call; the host store's engine counts as it goes. Shared (in an `Arc`) by every namespace's
//! handle on one store and by `kvtier._core.StoreStats`, which Python stores count into.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub struct StoreCounts {
    /// Values stored.
    pub puts: AtomicU64,
    /// Payload bytes of the values stored.
    pub put_bytes: AtomicU64,
    /// Puts refused or failed: over budget, disk full, server unreachable.
    pub put_failures: AtomicU64,
    pub hits: AtomicU64,
    /// Payload bytes of the values served.
    pub hit_bytes: AtomicU64,
    pub misses: AtomicU64,
    /// Values that failed a check (truncated, bit-flipped, foreign); each also counts as a miss.
    pub corrupt: AtomicU64,
    /// Backend errors (I/O, connection); gets that hit one also count as misses.
    pub errors: AtomicU64,
    pub evictions: AtomicU64,
    pub deletes: AtomicU64,
}

impl StoreCounts {
    /// A batch of puts: `stored` values of `payload_bytes` in all, `failed` refused or failed.
    pub fn count_puts(&self, stored: u64, payload_bytes: u64, failed: u64) {
        self.puts.fetch_add(stored, Relaxed);
        self.put_bytes.fetch_add(payload_bytes, Relaxed);
        self.put_failures.fetch_add(failed, Relaxed);
    }

    /// A batch of gets: `corrupt` of the `misses` failed a check.
    pub fn count_gets(&self, hits: u64, hit_bytes: u64, misses: u64, corrupt: u64) {
        self.hits.fetch_add(hits, Relaxed);
        self.hit_bytes.fetch_add(hit_bytes, Relaxed);
        self.misses.fetch_add(misses, Relaxed);
        self.corrupt.fetch_add(corrupt, Relaxed);
    }

    pub fn count_errors(&self, n: u64) {
        self.errors.fetch_add(n, Relaxed);
    }

    pub fn count_evictions(&self, n: u64) {
        self.evictions.fetch_add(n, Relaxed);
    }

    pub fn count_deletes(&self, n: u64) {
        self.deletes.fetch_add(n, Relaxed);
    }

    /// The counters by name, in a fixed order.
    pub fn fields(&self) -> [(&'static str, u64); 10] {
        [
            ("puts", self.puts.load(Relaxed)),
            ("put_bytes", self.put_bytes.load(Relaxed)),
            ("put_failures", self.put_failures.load(Relaxed)),
            ("hits", self.hits.load(Relaxed)),
            ("hit_bytes", self.hit_bytes.load(Relaxed)),
            ("misses", self.misses.load(Relaxed)),
            ("corrupt", self.corrupt.load(Relaxed)),
            ("errors", self.errors.load(Relaxed)),
            ("evictions", self.evictions.load(Relaxed)),
            ("deletes", self.deletes.load(Relaxed)),
        ]
    }
}
