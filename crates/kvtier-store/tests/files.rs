//! A disk store's engine on a real directory: what `kvtier.stores.DiskStore` promises
//! (tests/test_stores.py) — values round trip at every size around the read chunk, survive a
//! reopen, stay within the budget on disk, and a damaged, truncated or missing file is a miss.

use std::path::Path;

use kvtier::{PolicyKind, StoreIndex};
use kvtier_store::files::{
    read_sealed, read_stored, store_path, write_checksummed, write_stored, Put, Read, Write,
};
use kvtier_store::format::{pack_texts, HeaderSpec, CHECKSUM_BYTES};
use kvtier_store::{Error, Refusal, SharedIndex};

fn spec() -> HeaderSpec {
    HeaderSpec::new(
        0x00c0_ffee,
        pack_texts(&["int4", "float16", "L2xH4"]).unwrap(),
    )
}

fn key(name: &str) -> String {
    format!("kvtier:{:016x}:{name}", spec().digest)
}

fn index(budget: u64) -> SharedIndex {
    SharedIndex::new(StoreIndex::new(PolicyKind::Lru, budget, 0.9).unwrap())
}

/// Payload `n` bytes long, different for each `seed`.
fn payload(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Puts `values` (name, payload) in one batch; returns which were stored.
fn put(root: &str, index: &SharedIndex, values: &[(&str, Vec<u8>)], threads: usize) -> Vec<bool> {
    let keys: Vec<String> = values.iter().map(|(n, _)| key(n)).collect();
    let heads: Vec<Vec<u8>> = values
        .iter()
        .zip(&keys)
        .map(|((_, p), k)| {
            let mut head = Vec::new();
            spec().write_header(&mut head, k, p.len() as u64).unwrap();
            head
        })
        .collect();
    let puts: Vec<Put<'_>> = (0..values.len())
        .map(|i| Put {
            key: &keys[i],
            head: &heads[i],
            payload: &values[i].1,
        })
        .collect();
    let stored = write_stored(root, &puts, index, ".tmp-test-", false, threads).unwrap();
    assert!(stored.failures.is_empty(), "{:?}", stored.failures);
    stored.done
}

/// The payloads under `names`: Some(payload), None for a miss; panics on anything else.
fn get(root: &str, index: &SharedIndex, names: &[&str], threads: usize) -> Vec<Option<Vec<u8>>> {
    reads(root, index, names, threads)
        .into_iter()
        .map(|r| match r {
            Read::Value { data, payload } => Some(data[payload].to_vec()),
            Read::Missing => None,
            other => panic!("read {other:?}"),
        })
        .collect()
}

fn reads(root: &str, index: &SharedIndex, names: &[&str], threads: usize) -> Vec<Read> {
    let keys: Vec<String> = names.iter().map(|n| key(n)).collect();
    read_stored(root, &keys, spec().digest, &spec().texts, index, threads).unwrap()
}

fn path(root: &str, name: &str) -> String {
    store_path(root, &key(name)).unwrap()
}

/// Every file under `root`, temporary ones included.
fn files(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_dir() {
                dirs.push(entry.path());
            } else {
                out.push(entry.path().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn values_of_every_size_around_a_read_chunk_round_trip_on_any_number_of_threads() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let overhead = spec().sealed_len(&key("0"), 0);
    let chunk = 256 << 10;
    // Files just under, at and over a chunk (the checksum field split across two reads).
    let sizes: [usize; 8] = [
        0,
        1,
        100,
        chunk - 1,
        chunk,
        chunk + 4,
        2 * chunk + 8,
        2 * chunk + 9,
    ];
    let names: Vec<String> = (0..sizes.len()).map(|i| i.to_string()).collect();
    let values: Vec<(&str, Vec<u8>)> = names
        .iter()
        .zip(sizes)
        .map(|(n, s)| (n.as_str(), payload(s.saturating_sub(overhead), s as u8)))
        .collect();
    for threads in [1, 4] {
        let index = index(1 << 30);
        assert_eq!(
            put(root, &index, &values, threads),
            vec![true; values.len()]
        );
        let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
        let got = get(root, &index, &names, threads);
        let want: Vec<_> = values.iter().map(|(_, p)| Some(p.clone())).collect();
        assert_eq!(got, want);
    }
    // The file is the whole sealed value, checksum and all.
    let (name, value) = &values[2];
    let bytes = std::fs::read(path(root, name)).unwrap();
    assert_eq!(bytes, spec().seal(&key(name), value).unwrap());
}

#[test]
fn values_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let values: Vec<(&str, Vec<u8>)> = vec![("a", payload(10_000, 1)), ("b", payload(20, 2))];
    put(root, &index(1 << 20), &values, 2);
    // Another process, another index: the files are read by key, and by path.
    let fresh = index(1 << 20);
    let got = get(root, &fresh, &["a", "b", "c"], 2);
    assert_eq!(
        got,
        [Some(values[0].1.clone()), Some(values[1].1.clone()), None]
    );
    let texts = [
        &(key("a").len() as u16).to_le_bytes()[..],
        key("a").as_bytes(),
        &spec().texts,
    ]
    .concat();
    let pa = path(root, "a");
    let missing = format!("{root}/nothing");
    let by_path = read_sealed(&[(&pa, &texts), (&missing, &texts)], spec().digest, 1);
    assert!(
        matches!(&by_path[0], Read::Value { data, payload } if data[payload.clone()] == values[0].1[..])
    );
    assert!(matches!(&by_path[1], Read::Failed(e) if e.kind() == std::io::ErrorKind::NotFound));
}

#[test]
fn the_budget_holds_on_disk_and_evicts_the_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let one = (spec().sealed_len(&key("a"), 1000)) as u64;
    let index = index(3 * one);
    for name in ["a", "b", "c"] {
        assert_eq!(put(root, &index, &[(name, payload(1000, 0))], 1), [true]);
    }
    get(root, &index, &["a"], 1); // b is now the least recently used
    assert_eq!(put(root, &index, &[("d", payload(1000, 1))], 1), [true]);
    assert!(!Path::new(&path(root, "b")).exists());
    assert_eq!(get(root, &index, &["b"], 1), [None]);
    assert_eq!(files(dir.path()).len(), 3);
    // Larger than the whole budget: refused, and nothing is written.
    assert_eq!(put(root, &index, &[("huge", payload(4000, 0))], 1), [false]);
    assert!(!Path::new(&path(root, "huge")).exists());
    // A key given twice is written once, with its last value; a value evicted by a later one of
    // the batch leaves no file.
    let batch = vec![
        ("e", payload(1000, 5)),
        ("f", payload(1000, 6)),
        ("e", payload(1000, 7)),
        ("g", payload(1000, 8)),
        ("h", payload(1000, 9)),
    ];
    assert_eq!(put(root, &index, &batch, 2), [true; 5]);
    let on_disk = files(dir.path());
    assert_eq!(on_disk.len(), 3, "{on_disk:?}");
    assert_eq!(index.lock().used_bytes(), 3 * one);
    let held = get(root, &index, &["f", "e", "g", "h"], 1);
    let want = [
        None,
        Some(payload(1000, 7)),
        Some(payload(1000, 8)),
        Some(payload(1000, 9)),
    ];
    assert_eq!(held, want);
}

#[test]
fn a_damaged_truncated_or_missing_file_is_a_miss_and_the_rest_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let index = index(1 << 24);
    let values: Vec<(&str, Vec<u8>)> = ["flipped", "cut", "gone", "fine", "foreign"]
        .iter()
        .map(|n| (*n, payload(300_000, 3)))
        .collect();
    put(root, &index, &values, 1);
    let flipped = path(root, "flipped");
    let mut bytes = std::fs::read(&flipped).unwrap();
    let n = bytes.len();
    bytes[n - CHECKSUM_BYTES - 1] ^= 1; // the last payload byte
    std::fs::write(&flipped, bytes).unwrap();
    let cut = path(root, "cut");
    let bytes = std::fs::read(&cut).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 1]).unwrap();
    std::fs::remove_file(path(root, "gone")).unwrap();
    // Another key's value copied over this one's file.
    std::fs::copy(path(root, "fine"), path(root, "foreign")).unwrap();
    let got = reads(
        root,
        &index,
        &["flipped", "cut", "gone", "fine", "foreign"],
        2,
    );
    assert!(
        matches!(got[0], Read::Refused(Refusal::Checksum)),
        "{:?}",
        got[0]
    );
    assert!(
        matches!(got[1], Read::Refused(Refusal::Length { .. })),
        "{:?}",
        got[1]
    );
    assert!(matches!(got[2], Read::Missing));
    assert!(
        matches!(&got[3], Read::Value { data, payload } if data[payload.clone()] == values[3].1[..])
    );
    assert!(
        matches!(&got[4], Read::Refused(Refusal::Text { name: "key", .. })),
        "{:?}",
        got[4]
    );
    // A file that is gone leaves the index; a refused one stays until its store removes it.
    let index = index.lock();
    assert!(!index.contains(&path(root, "gone")));
    assert!(index.contains(&path(root, "flipped")));
}

#[test]
fn a_key_is_its_file_name_when_it_is_a_safe_one_else_its_hash() {
    let root = "/r";
    let p = store_path(root, "kvtier:00000000000000aa:0123456789abcdef").unwrap();
    let (dir, name) = p.rsplit_once('/').unwrap();
    assert!(dir.starts_with("/r/00000000000000aa/") && dir.len() == "/r/00000000000000aa/xx".len());
    assert_eq!(name, "0123456789abcdef");
    for unsafe_name in [".hidden", "a/b", "spaces in it", &"x".repeat(121)] {
        let p = store_path(root, &format!("kvtier:00000000000000aa:{unsafe_name}")).unwrap();
        let name = p.rsplit_once('/').unwrap().1;
        assert!(name.starts_with('~') && name.len() == 17, "{name}");
    }
    assert_eq!(
        store_path(root, "no-namespace"),
        Err(Error::NotAStoreKey {
            key: "no-namespace".into()
        })
    );
    // A bad key refuses the whole batch before anything is written or read.
    let dir = tempfile::tempdir().unwrap();
    let index = index(1 << 20);
    let puts = [
        Put {
            key: &key("fine"),
            head: b"",
            payload: b"",
        },
        Put {
            key: "bad",
            head: b"",
            payload: b"",
        },
    ];
    let root = dir.path().to_str().unwrap();
    assert!(write_stored(root, &puts, &index, ".tmp-", false, 1).is_err());
    assert!(files(dir.path()).is_empty() && index.lock().is_empty());
    let bad = ["bad".to_owned()];
    assert!(read_stored(root, &bad, 0, b"", &index, 1).is_err());
}

#[test]
fn a_write_goes_around_a_temporary_file_a_dead_process_left() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let index = index(1 << 20);
    put(root, &index, &[("a", payload(10, 0))], 1);
    let target = path(root, "a");
    let (parent, name) = target.rsplit_once('/').unwrap();
    let left = format!("{parent}/.tmp-test-{name}");
    std::fs::write(&left, b"a dead writer's bytes").unwrap();
    assert_eq!(put(root, &index, &[("a", payload(10, 1))], 1), [true]);
    assert_eq!(get(root, &index, &["a"], 1), [Some(payload(10, 1))]);
    assert_eq!(std::fs::read(&left).unwrap(), b"a dead writer's bytes");
    assert_eq!(files(dir.path()), {
        let mut both = vec![left, target];
        both.sort();
        both
    });
}

#[test]
fn a_file_written_checksummed_is_the_sealed_value_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let values: Vec<Vec<u8>> = vec![payload(4 * (256 << 10) + 3, 1), Vec::new(), payload(100, 2)];
    let keys: Vec<String> = (0..values.len()).map(|i| key(&i.to_string())).collect();
    let heads: Vec<Vec<u8>> = values
        .iter()
        .zip(&keys)
        .map(|(v, k)| {
            let mut head = Vec::new();
            spec().write_header(&mut head, k, v.len() as u64).unwrap();
            head
        })
        .collect();
    let paths: Vec<String> = (0..values.len()).map(|i| format!("{root}/{i}")).collect();
    let tmps: Vec<String> = (0..values.len())
        .map(|i| format!("{root}/.tmp-{i}"))
        .collect();
    for (threads, fsync) in [(1, false), (3, true)] {
        let writes: Vec<Write<'_>> = (0..values.len())
            .map(|i| Write {
                tmp: &tmps[i],
                path: &paths[i],
                head: &heads[i],
                payload: &values[i],
            })
            .collect();
        let written = write_checksummed(&writes, fsync, threads);
        assert!(written.iter().all(Result::is_ok), "{written:?}");
        for i in 0..values.len() {
            let want = spec().seal(&keys[i], &values[i]).unwrap();
            assert_eq!(std::fs::read(&paths[i]).unwrap(), want);
        }
    }
    // Into a directory that is not there: the error, and no temporary file left.
    let write = Write {
        tmp: &format!("{root}/missing/.tmp-x"),
        path: &format!("{root}/missing/x"),
        head: &heads[2],
        payload: &values[2],
    };
    let written = write_checksummed(&[write], false, 1);
    assert_eq!(
        written[0].as_ref().unwrap_err().kind(),
        std::io::ErrorKind::NotFound
    );
    assert_eq!(files(dir.path()).len(), values.len());
}

#[test]
fn a_batch_written_on_threads_ends_as_if_written_in_order() {
    let names: Vec<String> = (0..48).map(|i| format!("k{}", i % 40)).collect();
    let values: Vec<(&str, Vec<u8>)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), payload(64 << 10, i as u8)))
        .collect();
    let one = spec().sealed_len(&key("k00"), 64 << 10) as u64;
    let mut ends = Vec::new();
    for threads in [1, 4] {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap();
        let index = index(30 * one);
        put(root, &index, &values, threads);
        let on_disk: Vec<(String, Vec<u8>)> = files(dir.path())
            .into_iter()
            .map(|f| {
                let bytes = std::fs::read(&f).unwrap();
                (f.replacen(root, "", 1), bytes)
            })
            .collect();
        assert_eq!(on_disk.len(), 30);
        ends.push((
            on_disk,
            index
                .lock()
                .eviction_order()
                .into_iter()
                .map(|p| p.replacen(root, "", 1))
                .collect::<Vec<_>>(),
        ));
    }
    assert!(ends[0] == ends[1], "threads changed what the batch left");
}
