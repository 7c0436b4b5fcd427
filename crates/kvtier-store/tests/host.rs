//! A host store's engine: what `kvtier.stores.HostStore` promises (tests/test_stores.py), with
//! `Vec`s and `Arc`s for values instead of Python objects.

use std::sync::Arc;

use kvtier::{PolicyKind, StoreIndex};
use kvtier_store::format::{pack_texts, HeaderSpec};
use kvtier_store::host::{HostValues, Served};
use kvtier_store::{Refusal, SharedIndex, StoreCounts};

fn spec(digest: u64) -> HeaderSpec {
    HeaderSpec::new(digest, pack_texts(&["raw", "uint8", ""]).unwrap())
}

fn key(spec: &HeaderSpec, name: &str) -> String {
    format!("kvtier:{:016x}:{name}", spec.digest)
}

type Values = HostValues<Arc<[u8]>>;

fn store(budget: u64) -> Values {
    let index = StoreIndex::new(PolicyKind::Lru, budget, 0.9).unwrap();
    HostValues::new(
        Arc::new(SharedIndex::new(index)),
        Arc::new(StoreCounts::default()),
    )
}

fn put(store: &Values, spec: &HeaderSpec, name: &str, payload: &[u8]) -> bool {
    let key = key(spec, name);
    let sealed: Arc<[u8]> = spec.seal_unchecked(&key, payload).unwrap().into();
    store.put(key, sealed, payload.len() as u64)
}

/// The payload a read served, or None for a miss; panics on a refusal.
fn payload(served: Served<Arc<[u8]>>) -> Option<Vec<u8>> {
    match served {
        Served::Hit { value, payload } => Some(value[payload].to_vec()),
        Served::Miss => None,
        Served::Corrupt(reason) => panic!("refused: {reason}"),
    }
}

fn get(store: &Values, spec: &HeaderSpec, name: &str) -> Option<Vec<u8>> {
    payload(store.get(spec, &key(spec, name), Arc::clone))
}

fn counts(store: &Values) -> Vec<(&'static str, u64)> {
    store.counts().fields().to_vec()
}

fn count(store: &Values, name: &str) -> u64 {
    counts(store).iter().find(|(n, _)| *n == name).unwrap().1
}

#[test]
fn values_round_trip_single_and_batched_and_are_counted() {
    let ns = spec(1);
    let store = store(1 << 20);
    assert!(put(&store, &ns, "a", b"alpha"));
    assert!(put(&store, &ns, "empty", b""));
    assert_eq!(get(&store, &ns, "a").as_deref(), Some(&b"alpha"[..]));
    assert_eq!(get(&store, &ns, "empty").as_deref(), Some(&b""[..]));
    assert_eq!(get(&store, &ns, "missing"), None);
    let keys = ["a", "missing", "empty"].map(|n| key(&ns, n));
    let many: Vec<_> = store
        .get_many(&ns, &keys, Arc::clone)
        .into_iter()
        .map(payload)
        .collect();
    assert_eq!(many, [Some(b"alpha".to_vec()), None, Some(Vec::new())]);
    assert!(store.contains(&key(&ns, "a")));
    let mut scanned = store.scan(&key(&ns, ""));
    scanned.sort();
    assert_eq!(scanned, [key(&ns, "a"), key(&ns, "empty")]);
    assert_eq!(
        payload(store.pop(&ns, &key(&ns, "a"))).as_deref(),
        Some(&b"alpha"[..])
    );
    assert_eq!(payload(store.pop(&ns, &key(&ns, "a"))), None);
    assert_eq!(
        store.delete_many(&[key(&ns, "empty"), key(&ns, "never")]),
        [true, false]
    );
    assert!(store.is_empty() && store.index().lock().is_empty());
    let want = [
        ("puts", 2),
        ("put_bytes", 5),
        ("put_failures", 0),
        ("hits", 5),
        ("hit_bytes", 15),
        ("misses", 3),
        ("corrupt", 0),
        ("errors", 0),
        ("evictions", 0),
        ("deletes", 1),
    ];
    assert_eq!(counts(&store), want);
}

#[test]
fn namespaces_never_see_each_others_values() {
    let (a, b) = (spec(1), spec(2));
    let store = store(1 << 20);
    assert!(put(&store, &a, "k", b"of a"));
    assert_eq!(get(&store, &b, "k"), None); // another stored key
                                            // A value under the key of another namespace, or of another key, is refused and removed.
    let sealed: Arc<[u8]> = a.seal_unchecked(&key(&a, "k"), b"of a").unwrap().into();
    store.put(key(&b, "k"), Arc::clone(&sealed), 4);
    store.put(key(&a, "other"), sealed, 4);
    for (reader, name, reason) in [
        (&b, "k", "another namespace"),
        (&a, "other", "written as key"),
    ] {
        match store.get(reader, &key(reader, name), Arc::clone) {
            Served::Corrupt(r) => assert!(r.to_string().contains(reason), "{r}"),
            other => panic!("served {other:?}"),
        }
        assert!(!store.contains(&key(reader, name)));
    }
    assert_eq!(count(&store, "corrupt"), 2);
    assert_eq!(count(&store, "misses"), 3);
    assert_eq!(store.len(), 1);
    assert_eq!(store.index().lock().len(), 1);
}

#[test]
fn a_damaged_header_is_a_counted_miss_and_the_value_is_removed() {
    let ns = spec(1);
    let store = store(1 << 20);
    let k = key(&ns, "k");
    let mut sealed = ns.seal_unchecked(&k, b"payload").unwrap();
    sealed[4] ^= 0xFF; // the format version
    store.put(k.clone(), sealed.into(), 7);
    match store
        .get_many(&ns, std::slice::from_ref(&k), Arc::clone)
        .pop()
    {
        Some(Served::Corrupt(Refusal::Version { .. })) => {}
        other => panic!("served {other:?}"),
    }
    assert!(!store.contains(&k) && !store.index().lock().contains(&k));
    assert_eq!((count(&store, "corrupt"), count(&store, "misses")), (1, 1));
}

#[test]
fn the_budget_evicts_the_least_recently_used_and_refuses_the_oversized() {
    let ns = spec(1);
    let one = ns.sealed_len(&key(&ns, "a"), 100) as u64;
    let store = store(3 * one);
    for name in ["a", "b", "c"] {
        assert!(put(&store, &ns, name, &[1; 100]));
    }
    assert!(get(&store, &ns, "a").is_some()); // b is now the least recently used
    assert!(put(&store, &ns, "d", &[2; 100]));
    assert_eq!(get(&store, &ns, "b"), None);
    for name in ["a", "c", "d"] {
        assert!(get(&store, &ns, name).is_some(), "{name} was evicted");
    }
    assert!(!put(&store, &ns, "huge", &[0; 1000]));
    assert_eq!(store.len(), 3);
    assert_eq!(store.index().lock().used_bytes(), 3 * one);
    assert_eq!(count(&store, "evictions"), 1);
    assert_eq!(count(&store, "put_failures"), 1);
    // A replacement counts its bytes once.
    assert!(put(&store, &ns, "a", &[3; 100]));
    assert_eq!(store.index().lock().used_bytes(), 3 * one);
    assert_eq!(get(&store, &ns, "a"), Some(vec![3; 100]));
}

#[test]
fn a_value_read_outlives_its_eviction() {
    let ns = spec(1);
    let one = ns.sealed_len(&key(&ns, "a"), 10) as u64;
    let store = store(one);
    assert!(put(&store, &ns, "a", b"0123456789"));
    let Served::Hit { value, payload } = store.get(&ns, &key(&ns, "a"), Arc::clone) else {
        panic!("a miss");
    };
    assert!(put(&store, &ns, "b", b"abcdefghij")); // evicts a
    assert!(!store.contains(&key(&ns, "a")));
    assert_eq!(&value[payload], b"0123456789");
}

#[test]
fn a_closed_store_holds_nothing_and_admits_nothing() {
    let ns = spec(1);
    let store = store(1 << 20);
    assert!(put(&store, &ns, "a", b"x"));
    store.close();
    assert!(store.is_closed() && store.is_empty());
    assert!(store.index().lock().is_empty());
    assert!(!put(&store, &ns, "b", b"y"));
    assert!(store.is_empty() && store.index().lock().is_empty());
}

/// Threads putting, reading, popping and deleting overlapping keys under a tight budget: the
/// index and the values always agree, the budget holds, every value read is the one written
/// under its key, and every call is counted.
#[test]
fn concurrent_calls_keep_the_values_the_index_and_the_counts_consistent() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 2000;
    let ns = spec(9);
    let one = ns.sealed_len(&key(&ns, "00"), 64) as u64;
    let store = store(10 * one);
    // Key i's payload is 64 bytes of i: a read of the wrong value shows.
    let payload_of = |i: usize| vec![i as u8; 64];
    let (gets, puts) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (store, ns) = (&store, &ns);
                s.spawn(move || {
                    let (mut gets, mut puts) = (0u64, 0u64);
                    for round in 0..ROUNDS {
                        let i = (round * 7 + t * 13) % 32;
                        let name = format!("{i:02}");
                        match round % 5 {
                            0 | 1 => {
                                put(store, ns, &name, &payload_of(i));
                                puts += 1;
                            }
                            2 => {
                                if let Some(p) = get(store, ns, &name) {
                                    assert_eq!(p, payload_of(i));
                                }
                                gets += 1;
                            }
                            3 => {
                                let keys: Vec<String> = (0..4)
                                    .map(|d| key(ns, &format!("{:02}", (i + d) % 32)))
                                    .collect();
                                for (d, served) in store
                                    .get_many(ns, &keys, Arc::clone)
                                    .into_iter()
                                    .enumerate()
                                {
                                    if let Some(p) = payload(served) {
                                        assert_eq!(p, payload_of((i + d) % 32));
                                    }
                                }
                                gets += 4;
                            }
                            _ => {
                                if round % 10 == 4 {
                                    store.delete_many(&[key(ns, &name)]);
                                } else {
                                    if let Some(p) = payload(store.pop(ns, &key(ns, &name))) {
                                        assert_eq!(p, payload_of(i));
                                    }
                                    gets += 1;
                                }
                            }
                        }
                        let index = store.index().lock();
                        assert!(index.used_bytes() <= 10 * one);
                    }
                    (gets, puts)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap())
            .fold((0, 0), |(g, p), (wg, wp)| (g + wg, p + wp))
    });
    let index = store.index().lock();
    let held = store.scan("");
    assert_eq!(held.len(), index.len());
    assert!(held.iter().all(|k| index.contains(k)));
    assert_eq!(index.used_bytes(), held.len() as u64 * one);
    assert_eq!(count(&store, "puts") + count(&store, "put_failures"), puts);
    assert_eq!(count(&store, "hits") + count(&store, "misses"), gets);
    assert_eq!(count(&store, "corrupt"), 0);
}

/// Puts racing `close`: once `close` returns and the puts are done, the store holds nothing.
#[test]
fn puts_racing_close_leave_nothing_in_the_closed_store() {
    for _ in 0..20 {
        let ns = spec(3);
        let store = store(1 << 20);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (store, ns) = (&store, &ns);
                s.spawn(move || {
                    for i in 0..200 {
                        put(store, ns, &format!("{t}-{i}"), b"value");
                    }
                });
            }
            store.close();
        });
        assert!(store.is_empty() && store.index().lock().is_empty());
    }
}
