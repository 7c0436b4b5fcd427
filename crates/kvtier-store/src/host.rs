//! A host store's values in this process's memory ([`HostValues`]): sealed values under their
//! stored keys, within the byte budget of a [`SharedIndex`] (which also says what to evict),
//! counted in [`StoreCounts`], every read checked against the key and namespace it is read
//! under (the header only: host values never leave the process, so their checksum field is 0
//! and never verified).
//!
//! One `HostValues` holds the values of every namespace of a store; each call names the
//! namespace's [`HeaderSpec`]. The values are of any type that shows its sealed bytes
//! ([`Sealed`]): the bindings keep Python objects (memory of their own, or a pinned buffer from
//! torch), tests keep `Vec`s. A read clones the value out under the lock with the caller's
//! `clone` (for a Python object, a reference count), so a value stays valid after it was
//! evicted or replaced, as long as the reader holds it.
//!
//! Locks: the values' map, then the index, never the other way round. No value is dropped while
//! a lock is held (dropping one may run a finalizer in Python that waits on another thread),
//! and after `close` nothing is admitted again.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Refusal;
use crate::format::HeaderSpec;
use crate::index::SharedIndex;
use crate::stats::StoreCounts;

/// A value as a host store holds it: its sealed bytes (header, payload, checksum field).
pub trait Sealed: Send {
    fn sealed(&self) -> &[u8];
}

impl Sealed for Vec<u8> {
    fn sealed(&self) -> &[u8] {
        self
    }
}

impl Sealed for Box<[u8]> {
    fn sealed(&self) -> &[u8] {
        self
    }
}

impl Sealed for Arc<[u8]> {
    fn sealed(&self) -> &[u8] {
        self
    }
}

/// A read's result for one key.
#[derive(Debug)]
pub enum Served<V> {
    Miss,
    /// The value, and its payload's range in its sealed bytes.
    Hit {
        value: V,
        payload: Range<usize>,
    },
    /// A value that failed its checks: removed from the store, and counted.
    Corrupt(Refusal),
}

type ValueMap<V> = foldhash::HashMap<String, V>;

/// The values of one host store (see the module's doc).
pub struct HostValues<V> {
    index: Arc<SharedIndex>,
    counts: Arc<StoreCounts>,
    values: Mutex<ValueMap<V>>,
    closed: AtomicBool,
}

impl<V: Sealed> HostValues<V> {
    /// No values yet, within the budget of `index`, counted into `counts`.
    pub fn new(index: Arc<SharedIndex>, counts: Arc<StoreCounts>) -> Self {
        HostValues {
            index,
            counts,
            values: Mutex::new(ValueMap::default()),
            closed: AtomicBool::new(false),
        }
    }

    fn values(&self) -> MutexGuard<'_, ValueMap<V>> {
        self.values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    pub fn counts(&self) -> &StoreCounts {
        &self.counts
    }

    /// Whether [`Self::close`] has run.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Relaxed)
    }

    /// How many values the store holds (every namespace's).
    pub fn len(&self) -> usize {
        self.values().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admits a sealed value under its stored key, replacing what the key held and evicting
    /// what the index says; returns whether it was stored (not: larger than the whole budget,
    /// or the store is closed) and how many values it evicted. Counts nothing
    /// ([`Self::count_puts`] counts a batch).
    pub fn admit(&self, key: String, value: V) -> (bool, u64) {
        let size = value.sealed().len() as u64;
        let mut values = self.values();
        // A put that passed its caller's open check while `close` ran: `close` marks the store
        // closed before it empties the map, so under the map's lock this sees it and refuses
        // (else the value would stay in a closed store's map).
        if self.is_closed() {
            drop(values);
            return (false, 0);
        }
        let mut index = self.index.lock();
        let Some(victims) = index.admit(&key, size) else {
            drop((index, values));
            return (false, 0); // `value` is dropped here, after the locks
        };
        let evicted: Vec<V> = victims.iter().filter_map(|v| values.remove(v)).collect();
        let replaced = values.insert(key, value);
        drop((index, values));
        drop((evicted, replaced));
        (true, victims.len() as u64)
    }

    /// Counts a batch of puts: `stored` values of `stored_bytes` payload bytes, `refused`
    /// refused, `evicted` values evicted to make room.
    pub fn count_puts(&self, stored: u64, stored_bytes: u64, refused: u64, evicted: u64) {
        self.counts.count_puts(stored, stored_bytes, refused);
        self.counts.count_evictions(evicted);
    }

    /// Admits one value of `payload_bytes` and counts it; returns whether it was stored.
    pub fn put(&self, key: String, value: V, payload_bytes: u64) -> bool {
        let (stored, evicted) = self.admit(key, value);
        let bytes = if stored { payload_bytes } else { 0 };
        self.count_puts(u64::from(stored), bytes, u64::from(!stored), evicted);
        stored
    }

    /// What a read hands out for `value` found (or not) under `key`: the value once its header
    /// checks pass under `spec`; a value that fails them is removed.
    fn serve(&self, spec: &HeaderSpec, key: &str, value: Option<V>) -> Served<V> {
        let Some(value) = value else {
            return Served::Miss;
        };
        match spec.check(key, value.sealed(), false) {
            Ok(payload) => Served::Hit { value, payload },
            Err(reason) => {
                let gone = self.values().remove(key);
                self.index.lock().remove(key);
                drop((gone, value)); // after the locks
                Served::Corrupt(reason)
            }
        }
    }

    /// Counts a batch of reads.
    fn count_served(&self, served: &[Served<V>]) {
        let (mut hits, mut hit_bytes, mut corrupt) = (0, 0, 0);
        for s in served {
            match s {
                Served::Hit { payload, .. } => {
                    hits += 1;
                    hit_bytes += payload.len() as u64;
                }
                Served::Corrupt(_) => corrupt += 1,
                Served::Miss => {}
            }
        }
        let misses = served.len() as u64 - hits;
        self.counts.count_gets(hits, hit_bytes, misses, corrupt);
    }

    /// The value under `key` (read under `spec`), cloned out with `clone`; counted, and
    /// touched in the index when it is there.
    pub fn get(&self, spec: &HeaderSpec, key: &str, clone: impl FnOnce(&V) -> V) -> Served<V> {
        let value = self.values().get(key).map(clone);
        if value.is_some() {
            self.index.lock().touch(&[key]);
        }
        let served = self.serve(spec, key, value);
        self.count_served(std::slice::from_ref(&served));
        served
    }

    /// [`Self::get`] of each key, as one batch of reads (one touch of the index).
    pub fn get_many(
        &self,
        spec: &HeaderSpec,
        keys: &[String],
        clone: impl Fn(&V) -> V,
    ) -> Vec<Served<V>> {
        let found: Vec<Option<V>> = {
            let values = self.values();
            keys.iter().map(|k| values.get(k).map(&clone)).collect()
        };
        let hit_keys: Vec<&String> = keys
            .iter()
            .zip(&found)
            .filter_map(|(k, f)| f.as_ref().map(|_| k))
            .collect();
        self.index.lock().touch(&hit_keys);
        let served: Vec<Served<V>> = keys
            .iter()
            .zip(found)
            .map(|(key, value)| self.serve(spec, key, value))
            .collect();
        self.count_served(&served);
        served
    }

    /// Takes the value under `key` out of the store (checked and counted, as for a read).
    pub fn pop(&self, spec: &HeaderSpec, key: &str) -> Served<V> {
        let value = self.values().remove(key);
        self.index.lock().remove(key);
        let served = self.serve(spec, key, value);
        self.count_served(std::slice::from_ref(&served));
        served
    }

    /// Whether a value is stored under `key`.
    pub fn contains(&self, key: &str) -> bool {
        self.values().contains_key(key)
    }

    /// Deletes the values under `keys`; returns which there were, and counts them.
    pub fn delete_many(&self, keys: &[String]) -> Vec<bool> {
        let gone: Vec<Option<V>> = {
            let mut values = self.values();
            keys.iter().map(|k| values.remove(k)).collect()
        };
        let mut index = self.index.lock();
        for key in keys {
            index.remove(key);
        }
        drop(index);
        let done: Vec<bool> = gone.iter().map(Option::is_some).collect();
        drop(gone); // after the locks
        let deleted = done.iter().filter(|&&d| d).count() as u64;
        self.counts.count_deletes(deleted);
        done
    }

    /// The stored keys that start with `prefix`.
    pub fn scan(&self, prefix: &str) -> Vec<String> {
        self.values()
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect()
    }

    /// Closes the store, for every namespace: every value is dropped and none is admitted
    /// again.
    pub fn close(&self) {
        self.closed.store(true, Relaxed);
        let values = std::mem::take(&mut *self.values());
        let mut index = self.index.lock();
        for key in values.keys() {
            index.remove(key);
        }
        drop(index);
        drop(values);
    }
}
