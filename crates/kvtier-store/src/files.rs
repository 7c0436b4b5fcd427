//! A disk store's values as files: a batch read or written in one call, on several threads,
//! each value checksummed (CRC-64/NVME, [`crate::format`]'s trailing field) as it is read or
//! written, with as few system calls as it takes.
//!
//! Where a value lives: [`store_path`]. A write goes to a new temporary file in the value's
//! directory and is renamed over its name, so a reader (in this or another process) sees the
//! old value or the new one, never part of one; with `fsync`, the file is synced before the
//! rename and its directory after, so the value survives a power loss. A read checks the whole
//! value against the key and namespace it is read under ([`crate::format::check`]).
//!
//! [`write_stored`] and [`read_stored`] are a store's put and get: they also keep the store's
//! [`SharedIndex`] (its budget and eviction order) and delete the files it evicts. The
//! directory walk that rebuilds the index when a store opens is the Python store's
//! (`kvtier.stores.DiskStore`).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::{self, IoSlice, Write as _};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use twox_hash::XxHash3_64;

use crate::checksum::Checksum;
use crate::error::{Error, Refusal, Result};
use crate::format::{check, Expected, CHECKSUM_BYTES};
use crate::index::SharedIndex;

/// How long this thread works through a batch alone before it calls helpers: a few times what
/// starting a thread costs (25-30 us on a 2-CPU VM), so a batch of a few small files, which
/// threads would slow down, never starts one.
const HELP_AFTER: Duration = Duration::from_micros(100);

/// `f` of every item, in item order, computed on up to `threads` threads (this one among them,
/// which calls the others only once the batch has taken `HELP_AFTER`). Each thread takes the
/// next item nobody has taken, so one large file does not hold up the others.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let take = || {
        let i = next.fetch_add(1, Ordering::Relaxed);
        items.get(i).map(|item| (i, f(item)))
    };
    let left = || items.len().saturating_sub(next.load(Ordering::Relaxed));
    let mut out: Vec<Option<R>> = std::iter::repeat_with(|| None).take(items.len()).collect();
    let start = Instant::now();
    std::thread::scope(|s| {
        let mut helpers = Vec::new();
        while let Some((i, r)) = take() {
            out[i] = Some(r);
            if helpers.is_empty() && left() > 0 && threads > 1 && start.elapsed() >= HELP_AFTER {
                helpers = (1..threads.min(left() + 1))
                    .map(|_| s.spawn(|| std::iter::from_fn(take).collect::<Vec<_>>()))
                    .collect();
            }
        }
        for helper in helpers {
            for (i, r) in helper.join().expect("a file I/O thread panicked") {
                out[i] = Some(r);
            }
        }
    });
    out.into_iter()
        .map(|r| r.expect("every item was taken"))
        .collect()
}

/// Bytes of a value read and then hashed, or written and then hashed, at a time, so that the
/// hash reads them from cache. (The write's copy into the page cache is bound by its writes, so
/// it gains nothing from reading cached bytes: hashing first and then writing added a pass over
/// memory, 2 MiB: +30-39 % over plain files, 2-CPU VM.)
const CHUNK: usize = 256 << 10;

/// Reads up to `max` bytes from `file` onto the end of `data`, into its spare capacity (at
/// least one byte of which must be free) without initialising it first; returns how many.
#[allow(unsafe_code)] // the crate's one use: a read into uninitialised capacity
fn read_more(file: &File, data: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let spare = data.spare_capacity_mut();
    let (at, want) = (spare.as_mut_ptr().cast(), spare.len().min(max));
    loop {
        // SAFETY: `at` points to `want` bytes of `data`'s spare capacity, which the kernel
        // writes; exactly the `n` bytes it reports are then initialised, and `len + n` is
        // within the capacity.
        let n = unsafe { libc::read(file.as_raw_fd(), at, want) };
        if let Ok(n) = usize::try_from(n) {
            unsafe { data.set_len(data.len() + n) };
            return Ok(n);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Reads one stored value whole: its bytes and the checksum of all but the last 8 (its own
/// checksum field). The buffer is sized from the file's length and filled a `CHUNK` per
/// `read` (a value up to `CHUNK` in one, and one that finds the end), each chunk hashed just
/// after it is read, from cache: hashing a 2 MiB value once it was all read went back to
/// memory for most of it.
///
/// A value is read on one thread: splitting one 2 MiB value between two threads made it slower
/// (+30 % against +12 % over `open().read()`, 2-CPU VM), so threads go to the values of a batch.
fn read_one(path: &str) -> io::Result<(Vec<u8>, u64)> {
    let file = File::open(path)?;
    let size = usize::try_from(file.metadata()?.len()).unwrap_or(0);
    // One byte more: the read that finds the end needs room.
    let mut data = Vec::with_capacity(size.saturating_add(1));
    let mut sum = Checksum::new();
    let mut hashed = 0;
    loop {
        if data.len() == data.capacity() {
            data.reserve(CHUNK); // the file grew since its length was read
        }
        let n = read_more(&file, &mut data, CHUNK)?;
        // The last 8 bytes so far may be the checksum field: hashed once more bytes follow.
        let upto = data.len().saturating_sub(CHECKSUM_BYTES);
        if upto > hashed {
            sum.update(&data[hashed..upto]);
            hashed = upto;
        }
        if n == 0 {
            return Ok((data, sum.value()));
        }
    }
}

/// Writes all of `bufs`, however many calls it takes.
fn write_all_vectored(mut file: &File, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0); // skips leading empty buffers
    while !bufs.is_empty() {
        match file.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn create_new(path: &str) -> io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o644);
    options.open(path)
}

/// Creates the temporary file `tmp`, or, where a file of that name is already there (left by a
/// dead process that had this one's id), a new file named `tmp` plus a number; never opens a
/// file that exists, so no other writer's file is ever written into. Returns the name used.
fn create_temporary(tmp: &str) -> io::Result<(File, String)> {
    static AROUND: AtomicUsize = AtomicUsize::new(0);
    match create_new(tmp) {
        Ok(file) => return Ok((file, tmp.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    loop {
        let name = format!("{tmp}-{}", AROUND.fetch_add(1, Ordering::Relaxed));
        match create_new(&name) {
            Ok(file) => return Ok((file, name)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
}

/// One value to write: `head`, then `payload`, then the checksum of both, written to the new
/// file `tmp` (or, where a file of that name is there, a new name that starts with it) and
/// renamed over `path`.
#[derive(Debug, Clone, Copy)]
pub struct Write<'a> {
    pub tmp: &'a str,
    pub path: &'a str,
    pub head: &'a [u8],
    pub payload: &'a [u8],
}

/// Writes one value (see [`Write`]), then closes the file and renames it: a reader sees the old
/// value or the new one, never part of one. On failure the temporary file is removed. Each
/// `CHUNK` is checksummed just after it is written. (Checksumming a large value on a thread of
/// its own beside its writing paid when the checksum was xxh3; with CRC-64 it made 1-2 MiB puts
/// 5 points slower, 2-CPU VM.)
fn write_one(value: &Write<'_>, fsync: bool) -> io::Result<()> {
    let (file, tmp) = create_temporary(value.tmp)?;
    let write = |file: File| -> io::Result<()> {
        let mut sum = Checksum::new();
        let mut lead = value.head;
        for chunk in value.payload.chunks(CHUNK) {
            write_all_vectored(&file, &mut [IoSlice::new(lead), IoSlice::new(chunk)])?;
            sum.update(lead);
            sum.update(chunk);
            lead = &[];
        }
        sum.update(lead); // the header of an empty value
        if !lead.is_empty() {
            write_all_vectored(&file, &mut [IoSlice::new(lead)])?;
        }
        write_all_vectored(&file, &mut [IoSlice::new(&sum.value().to_le_bytes())])?;
        if fsync {
            file.sync_all()?;
        }
        Ok(())
    };
    let done = write(file).and_then(|()| std::fs::rename(&tmp, value.path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// After an fsync'd batch: syncs each directory a value was renamed into, once, so that the
/// renames survive a power loss too (a file's own fsync does not cover its name). A value whose
/// directory could not be synced is reported as failed: it is readable, but not durable.
fn sync_directories(values: &[Write<'_>], written: &mut [io::Result<()>], threads: usize) {
    let parent = |p: &str| {
        let dir = std::path::Path::new(p)
            .parent()
            .map(std::path::Path::as_os_str);
        dir.filter(|d| !d.is_empty())
            .unwrap_or(".".as_ref())
            .to_owned()
    };
    let dirs: Vec<_> = values
        .iter()
        .zip(written.iter())
        .filter(|(_, w)| w.is_ok())
        .map(|(v, _)| parent(v.path))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let synced = parallel_map(&dirs, threads, |d| File::open(d)?.sync_all());
    for (value, w) in values.iter().zip(written.iter_mut()) {
        let dir = parent(value.path);
        if let (Ok(()), Ok(at)) = (&w, dirs.binary_search(&dir)) {
            if let Err(e) = &synced[at] {
                let what = format!("syncing directory {}: {e}", dir.to_string_lossy());
                *w = Err(io::Error::new(e.kind(), what));
            }
        }
    }
}

/// Creates the directory `path` goes in, with its parents; with `fsync`, also syncs the two
/// directories above it (a store's namespace directory and root), so the new names survive a
/// power loss.
fn make_parent(path: &str, fsync: bool) -> io::Result<()> {
    let dir = std::path::Path::new(path)
        .parent()
        .ok_or(io::ErrorKind::NotFound)?;
    std::fs::create_dir_all(dir)?;
    if fsync {
        for above in dir.ancestors().skip(1).take(2) {
            File::open(above)?.sync_all()?;
        }
    }
    Ok(())
}

/// Writes each value ([`write_one`]) on up to `threads` threads; with `make_dirs`, a directory
/// that is not there is made and the write tried again; with `fsync`, each directory written
/// into is synced after.
fn write_batch(
    values: &[Write<'_>],
    fsync: bool,
    threads: usize,
    make_dirs: bool,
) -> Vec<io::Result<()>> {
    let mut written = parallel_map(values, threads, |v| match write_one(v, fsync) {
        Err(e) if make_dirs && e.kind() == io::ErrorKind::NotFound => {
            make_parent(v.path, fsync).and_then(|()| write_one(v, fsync))
        }
        done => done,
    });
    if fsync {
        sync_directories(values, &mut written, threads);
    }
    written
}

/// Writes `values` on up to `threads` threads (see [`Write`]; with `fsync`, each file is synced
/// before and its directory after the rename, so the value survives a power loss). For each
/// value in order: written, or the error writing it (its temporary file is removed; what its
/// path held before is untouched), or syncing its directory.
pub fn write_checksummed(values: &[Write<'_>], fsync: bool, threads: usize) -> Vec<io::Result<()>> {
    write_batch(values, fsync, threads, false)
}

/// One value read and checked.
#[derive(Debug)]
pub enum Read {
    /// The bytes read, and the payload's range in them.
    Value {
        data: Vec<u8>,
        payload: Range<usize>,
    },
    /// A value that failed a check.
    Refused(Refusal),
    /// No file ([`read_stored`]; [`read_sealed`] reports a missing file as `Failed`).
    Missing,
    /// The error reading it.
    Failed(io::Error),
}

/// Reads `(path, texts)` on up to `threads` threads and checks each value against the namespace
/// `digest` and its header texts (the key's and the namespace's, packed).
fn read_checked(reads: &[(&str, &[u8])], digest: u64, threads: usize) -> Vec<Read> {
    parallel_map(reads, threads, |&(path, texts)| match read_one(path) {
        Ok((data, hashed)) => {
            let want = Expected {
                digest,
                texts: &[texts],
            };
            match check(&data, Some(hashed), &want, true) {
                Ok(payload) => Read::Value { data, payload },
                Err(reason) => Read::Refused(reason),
            }
        }
        Err(e) => Read::Failed(e),
    })
}

/// Reads the values at the paths of `reads` on up to `threads` threads, each checked against
/// the namespace `digest` and its header texts (key, codec, dtype, shape, packed). One bad
/// file does not stop the others.
pub fn read_sealed(reads: &[(&str, &[u8])], digest: u64, threads: usize) -> Vec<Read> {
    read_checked(reads, digest, threads)
}

/// Whether a disk store keeps a value under its own name: 1-120 characters of `A-Za-z0-9_.=-`,
/// not starting with a dot (temporary files do).
fn is_safe_name(name: &str) -> bool {
    let allowed = |c: &u8| c.is_ascii_alphanumeric() || b"_.=-".contains(c);
    let bytes = name.as_bytes();
    (1..=120).contains(&bytes.len()) && bytes[0] != b'.' && bytes.iter().all(allowed)
}

/// Where the disk store at `root` keeps the value under the store key `key`
/// (`kvtier:<namespace digest>:<name>`): `<root>/<namespace digest>/<xx>/<name>`, `xx` the low
/// byte of the key's xxh3-64 in hex (256 directories a namespace), and `~` and the whole
/// xxh3-64 in hex in place of a name that is not a safe file name (the header inside names the
/// key either way).
pub fn store_path(root: &str, key: &str) -> Result<String> {
    let mut parts = key.splitn(3, ':');
    let (Some(_), Some(namespace), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(Error::NotAStoreKey { key: key.into() });
    };
    let digest = XxHash3_64::oneshot_with_seed(0, key.as_bytes());
    let shard = digest & 0xFF;
    Ok(if is_safe_name(name) {
        format!("{root}/{namespace}/{shard:02x}/{name}")
    } else {
        format!("{root}/{namespace}/{shard:02x}/~{digest:016x}")
    })
}

/// A disk store's get, in one call: the values under the store `keys` in the store at `root`
/// ([`store_path`]), read on up to `threads` threads and checked against the namespace
/// `digest` and its header texts after the key (`texts`: codec, dtype, shape, packed). The keys
/// read are touched in `index`, and a key whose file is gone leaves it (`Read::Missing`). A
/// key that is not a store key refuses the whole batch before anything is read.
pub fn read_stored(
    root: &str,
    keys: &[String],
    digest: u64,
    texts: &[u8],
    index: &SharedIndex,
    threads: usize,
) -> Result<Vec<Read>> {
    let paths = keys
        .iter()
        .map(|key| store_path(root, key))
        .collect::<Result<Vec<_>>>()?;
    let heads: Vec<Vec<u8>> = keys
        .iter()
        .map(|key| {
            // The key as a header packs it (keys are at most a few hundred bytes).
            let len = u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes();
            [&len[..], key.as_bytes(), texts].concat()
        })
        .collect();
    let reads: Vec<(&str, &[u8])> = paths
        .iter()
        .zip(&heads)
        .map(|(p, h)| (p.as_str(), h.as_slice()))
        .collect();
    let mut read = read_checked(&reads, digest, threads);
    let (mut hits, mut gone) = (Vec::new(), Vec::new());
    for (path, r) in paths.iter().zip(&mut read) {
        match r {
            Read::Value { .. } => hits.push(path),
            Read::Failed(e) if e.kind() == io::ErrorKind::NotFound => {
                gone.push(path);
                *r = Read::Missing;
            }
            _ => {}
        }
    }
    let mut index = index.lock();
    for path in gone {
        index.remove(path);
    }
    index.touch(&hits);
    Ok(read)
}

/// One value of a put: stored under `key`, `head` (its header), then `payload`, then the
/// checksum of both.
#[derive(Debug, Clone, Copy)]
pub struct Put<'a> {
    pub key: &'a str,
    pub head: &'a [u8],
    pub payload: &'a [u8],
}

/// What [`write_stored`] did: whether each value is stored, the error of each value whose write
/// failed (by its place in the batch), and how many values were evicted.
#[derive(Debug, Default)]
pub struct Stored {
    pub done: Vec<bool>,
    pub failures: Vec<(usize, io::Error)>,
    pub evicted: usize,
}

/// A disk store's put, in one call: `puts` written to their files in the store at `root`
/// ([`store_path`]), each through the temporary name `tmp_tag` + its file name, on up to
/// `threads` threads, and counted in `index`.
///
/// As puts in order would: a key given twice is written once, with its last value that fits
/// the budget; room is made before anything is written (the evicted values' files are
/// deleted), so the budget holds on disk while the batch is written; a value evicted by a later
/// one of the batch leaves no file. A write that fails leaves the old value, counted again. A
/// key to be written that is not a store key refuses the whole batch before anything is
/// written.
pub fn write_stored(
    root: &str,
    puts: &[Put<'_>],
    index: &SharedIndex,
    tmp_tag: &str,
    fsync: bool,
    threads: usize,
) -> Result<Stored> {
    let sizes: Vec<u64> = puts
        .iter()
        .map(|p| (p.head.len() + p.payload.len() + CHECKSUM_BYTES) as u64)
        .collect();
    let budget = index.lock().budget();
    let last: HashMap<&str, usize> = (0..puts.len())
        .filter(|&i| sizes[i] <= budget)
        .map(|i| (puts[i].key, i))
        .collect();
    let at: Vec<usize> = (0..puts.len())
        .filter(|&i| last.get(puts[i].key) == Some(&i))
        .collect();
    let paths = at
        .iter()
        .map(|&i| store_path(root, puts[i].key))
        .collect::<Result<Vec<_>>>()?;
    let tmps: Vec<String> = paths
        .iter()
        .map(|p| {
            let (dir, name) = p.rsplit_once('/').unwrap_or((".", p));
            format!("{dir}/{tmp_tag}{name}")
        })
        .collect();
    let mut victims = Vec::new();
    {
        let mut index = index.lock();
        for (&i, path) in at.iter().zip(&paths) {
            victims.extend(index.admit(path, sizes[i]).unwrap_or_default());
        }
    }
    let writes: Vec<Write<'_>> = at
        .iter()
        .zip(paths.iter().zip(&tmps))
        .map(|(&i, (path, tmp))| Write {
            tmp,
            path,
            head: puts[i].head,
            payload: puts[i].payload,
        })
        .collect();
    for victim in &victims {
        let _ = std::fs::remove_file(victim);
    }
    let written = write_batch(&writes, fsync, threads, true);
    let mut evicted = victims.len();
    let mut stored = vec![false; puts.len()];
    let mut failures = Vec::new();
    let mut index = index.lock();
    for ((&i, path), result) in at.iter().zip(&paths).zip(written) {
        match result {
            Ok(()) => {
                stored[i] = true;
                if !index.contains(path) {
                    let _ = std::fs::remove_file(path); // evicted by a later value of the batch
                }
            }
            Err(e) => {
                index.remove(path);
                if let Ok(old) = std::fs::metadata(path) {
                    let pushed_out = index.admit(path, old.len()).unwrap_or_default();
                    evicted += pushed_out.len();
                    for victim in pushed_out {
                        let _ = std::fs::remove_file(victim);
                    }
                }
                failures.push((i, e));
            }
        }
    }
    drop(index);
    let done = (0..puts.len())
        .map(|i| sizes[i] <= budget && stored[last[puts[i].key]])
        .collect();
    Ok(Stored {
        done,
        failures,
        evicted,
    })
}
