//! Stored values in files (`kvtier.stores.DiskStore`): a batch read or written in one call,
//! without the GIL, on several threads, each value checksummed (CRC-64/NVME, the stored-value
//! checksum of `kvtier.stores.format`) and read or written with as few system calls as it takes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, IoSlice, Write as _};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use twox_hash::XxHash3_64;

use crate::checksum::Checksum;
use crate::sealed::{check, payload_error, Expected};
use crate::store_index::PyStoreIndex;

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
        let upto = data.len().saturating_sub(8);
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

/// Writes `head`, `payload` and the checksum of both (little-endian) to the new file `tmp`, then
/// closes it and renames it to `path`: a reader sees the old value or the new one, never part
/// of one. On failure the temporary file is removed. Each `CHUNK` is checksummed just after it
/// is written. (Checksumming a large value on a thread of its own beside its writing paid when
/// the checksum was xxh3; with CRC-64 it made 1-2 MiB puts 5 points slower, 2-CPU VM.)
fn write_one(tmp: &str, path: &str, head: &[u8], payload: &[u8], fsync: bool) -> io::Result<()> {
    let (file, tmp) = create_temporary(tmp)?;
    let write = |file: File| -> io::Result<()> {
        let mut sum = Checksum::new();
        let mut lead = head;
        for chunk in payload.chunks(CHUNK) {
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
    let done = write(file).and_then(|()| std::fs::rename(&tmp, path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// After an fsync'd batch: syncs each directory a value was renamed into, once, so that the
/// renames survive a power loss too (a file's own fsync does not cover its name). A value whose
/// directory could not be synced is reported as failed: it is readable, but not durable.
fn sync_directories(paths: &[String], written: &mut [io::Result<()>], threads: usize) {
    use std::collections::BTreeSet;
    let parent = |p: &str| {
        let dir = std::path::Path::new(p).parent().map(|d| d.as_os_str());
        dir.filter(|d| !d.is_empty())
            .unwrap_or(".".as_ref())
            .to_owned()
    };
    let dirs: Vec<_> = paths
        .iter()
        .zip(written.iter())
        .filter(|(_, w)| w.is_ok())
        .map(|(p, _)| parent(p))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let synced = parallel_map(&dirs, threads, |d| File::open(d)?.sync_all());
    for (path, w) in paths.iter().zip(written.iter_mut()) {
        let dir = parent(path);
        if let (Ok(()), Ok(at)) = (&w, dirs.binary_search(&dir)) {
            if let Err(e) = &synced[at] {
                let what = format!("syncing directory {}: {e}", dir.to_string_lossy());
                *w = Err(io::Error::new(e.kind(), what));
            }
        }
    }
}

/// One value read and checked: its bytes and its payload's range in them, or the check it
/// failed; or the error reading it.
type Read = io::Result<(Vec<u8>, Result<(usize, usize), String>)>;

/// Reads the values at `paths` on up to `threads` threads and checks each as `format.unseal`
/// does against the namespace `digest` and its header texts `texts[i]`.
fn read_checked(paths: &[String], digest: u64, texts: &[Vec<u8>], threads: usize) -> Vec<Read> {
    let items: Vec<usize> = (0..paths.len()).collect();
    parallel_map(&items, threads, |&i| {
        read_one(&paths[i]).map(|(data, hashed)| {
            let want = Expected {
                digest,
                texts: &[&texts[i]],
            };
            let span = check(&data, Some(hashed), &want, true);
            (data, span)
        })
    })
}

/// A read as Python gets it: the payload as a read-only memoryview (over the numpy array that
/// owns the bytes read), the `PayloadError` of a value that failed a check, or the `OSError`.
fn served(py: Python<'_>, read: Read) -> PyResult<Py<PyAny>> {
    Ok(match read {
        Ok((data, Ok((start, stop)))) => {
            let array = numpy::PyArray1::from_vec(py, data);
            crate::sealed::read_only_span(array.as_any(), start, stop, true, false)?.unbind()
        }
        Ok((_, Err(reason))) => payload_error(py, reason).into_value(py).into_any(),
        Err(e) => PyErr::from(e).into_value(py).into_any(),
    })
}

/// Reads stored values from `paths` on up to `threads` threads, without the GIL, and checks
/// each as `format.unseal` does against the namespace `digest` and its header `texts[i]`
/// (`format.header_texts`). For each path in order: the payload (a read-only memoryview), the
/// `PayloadError` a value that fails a check gets, or the `OSError` reading it raised (say
/// `FileNotFoundError`). One bad file does not stop the others.
#[pyfunction]
#[pyo3(signature = (paths, digest, texts, threads = 1))]
pub fn read_sealed(
    py: Python<'_>,
    paths: Vec<String>,
    digest: u64,
    texts: Vec<Vec<u8>>,
    threads: usize,
) -> PyResult<Vec<Py<PyAny>>> {
    if texts.len() != paths.len() {
        return Err(crate::errors::to_py(kvtier::Error::LengthMismatch {
            what: "texts",
            expected: paths.len(),
            got: texts.len(),
        }));
    }
    let read = py.detach(|| read_checked(&paths, digest, &texts, threads));
    read.into_iter().map(|r| served(py, r)).collect()
}

/// Whether a disk store keeps a value under its own name: 1-120 characters of `A-Za-z0-9_.=-`,
/// not starting with a dot (temporary files do).
fn is_safe_name(name: &str) -> bool {
    let allowed = |c: &u8| c.is_ascii_alphanumeric() || b"_.=-".contains(c);
    let bytes = name.as_bytes();
    (1..=120).contains(&bytes.len()) && bytes[0] != b'.' && bytes.iter().all(allowed)
}

fn path_of(root: &str, key: &str) -> PyResult<String> {
    let mut parts = key.splitn(3, ':');
    let (Some(_), Some(namespace), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(crate::errors::to_py(kvtier::Error::InvalidArgument {
            what: "key",
            reason: format!("{key:?}; expected a store key, kvtier:<namespace digest>:<name>"),
        }));
    };
    let digest = XxHash3_64::oneshot_with_seed(0, key.as_bytes());
    let shard = digest & 0xFF;
    Ok(if is_safe_name(name) {
        format!("{root}/{namespace}/{shard:02x}/{name}")
    } else {
        format!("{root}/{namespace}/{shard:02x}/~{digest:016x}")
    })
}

/// Where the disk store at `root` keeps the value under the store key `key`
/// (`kvtier:<namespace digest>:<name>`): `<root>/<namespace digest>/<xx>/<name>`, `xx` the low
/// byte of the key's xxh3-64 in hex (256 directories a namespace), and `~` and the whole
/// xxh3-64 in hex in place of a name that is not a safe file name (the header inside names the
/// key either way).
#[pyfunction]
pub fn store_path(root: &str, key: &str) -> PyResult<String> {
    path_of(root, key)
}

/// A disk store's get, in one call: the values under the store `keys` in the store at `root`
/// (`store_path`), read on up to `threads` threads without the GIL and checked against the
/// namespace `digest` and the header texts after the key (`Namespace.packed_texts`). The keys
/// read are touched in `index`, and a key whose file is gone leaves it. For each key: the
/// payload (a read-only memoryview), None (no file), the `PayloadError` of a value that failed
/// a check, or the `OSError` reading it raised.
#[pyfunction]
#[pyo3(signature = (root, keys, digest, texts, index, threads = 1))]
pub fn read_stored(
    py: Python<'_>,
    root: &str,
    keys: Vec<String>,
    digest: u64,
    texts: &[u8],
    index: &Bound<'_, PyStoreIndex>,
    threads: usize,
) -> PyResult<Vec<Py<PyAny>>> {
    let paths = keys
        .iter()
        .map(|key| path_of(root, key))
        .collect::<PyResult<Vec<_>>>()?;
    let heads: Vec<Vec<u8>> = keys
        .iter()
        .map(|key| {
            // The key as format.header_texts packs it (keys are at most a few hundred bytes).
            let len = u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes();
            [&len[..], key.as_bytes(), texts].concat()
        })
        .collect();
    let read = py.detach(|| read_checked(&paths, digest, &heads, threads));
    let (mut hits, mut gone) = (Vec::new(), Vec::new());
    let mut out = Vec::with_capacity(read.len());
    for (path, r) in paths.into_iter().zip(read) {
        match &r {
            Ok((_, Ok(_))) => hits.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                gone.push(path);
                out.push(py.None());
                continue;
            }
            _ => {}
        }
        out.push(served(py, r)?);
    }
    let mut index = index.get().lock();
    for path in &gone {
        index.remove(path);
    }
    index.touch(&hits);
    Ok(out)
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

/// Writes value `i` (`heads[i]`, `bodies[i]`, checksum) through `tmps[i]` to `paths[i]` on up
/// to `threads` threads (`write_one`); with `make_dirs`, a directory that is not there is made
/// and the write tried again.
fn write_batch(
    tmps: &[String],
    paths: &[String],
    heads: &[&[u8]],
    bodies: &[&[u8]],
    fsync: bool,
    threads: usize,
    make_dirs: bool,
) -> Vec<io::Result<()>> {
    let items: Vec<usize> = (0..paths.len()).collect();
    let write = |i: usize| write_one(&tmps[i], &paths[i], heads[i], bodies[i], fsync);
    let mut written = parallel_map(&items, threads, |&i| match write(i) {
        Err(e) if make_dirs && e.kind() == io::ErrorKind::NotFound => {
            make_parent(&paths[i], fsync).and_then(|()| write(i))
        }
        done => done,
    });
    if fsync {
        sync_directories(paths, &mut written, threads);
    }
    written
}

/// That every column of a batch has its `n` items.
fn check_lengths(n: usize, columns: &[(&'static str, usize)]) -> PyResult<()> {
    for &(what, got) in columns {
        if got != n {
            return Err(crate::errors::to_py(kvtier::Error::LengthMismatch {
                what,
                expected: n,
                got,
            }));
        }
    }
    Ok(())
}

/// Writes stored values on up to `threads` threads, without the GIL: value `i` is `heads[i]`,
/// then `payloads[i]` (bytes-like), then the checksum of both, written to the new file
/// `tmp_paths[i]` (or, where a file of that name is there, a new name that starts with it) and
/// renamed over `paths[i]` (with `fsync`, the file is synced before and its
/// directory after the rename, so the value survives a power loss). For each value in order,
/// None when it was written or the `OSError` writing it raised (its temporary file is removed;
/// what `paths[i]` held before is untouched), or syncing its directory raised.
#[pyfunction]
#[pyo3(signature = (tmp_paths, paths, heads, payloads, *, fsync = false, threads = 1))]
pub fn write_checksummed(
    py: Python<'_>,
    tmp_paths: Vec<String>,
    paths: Vec<String>,
    heads: Vec<Vec<u8>>,
    payloads: Vec<Bound<'_, PyAny>>,
    fsync: bool,
    threads: usize,
) -> PyResult<Vec<Py<PyAny>>> {
    let columns = [
        ("paths", paths.len()),
        ("heads", heads.len()),
        ("payloads", payloads.len()),
    ];
    check_lengths(tmp_paths.len(), &columns)?;
    let arrays: Vec<PyReadonlyArray1<'_, u8>> = crate::checksum::byte_arrays(&payloads)?;
    let bodies = crate::checksum::byte_slices(&arrays)?;
    let heads: Vec<&[u8]> = heads.iter().map(Vec::as_slice).collect();
    let written =
        py.detach(|| write_batch(&tmp_paths, &paths, &heads, &bodies, fsync, threads, false));
    Ok(written
        .into_iter()
        .map(|r| match r {
            Ok(()) => py.None(),
            Err(e) => PyErr::from(e).into_value(py).into_any(),
        })
        .collect())
}

/// What `write_stored` reports: whether each value was stored, `(i, OSError)` for each value
/// whose write failed, and how many values were evicted.
type Stored = (Vec<bool>, Vec<(usize, Py<PyAny>)>, usize);

/// A disk store's put, in one call: the values under the store `keys` (each `heads[i]`, then
/// `payloads[i]`, then the checksum) written to their files in the store at `root`
/// (`store_path`), each through the temporary name `tmp_tag` + its file name, on up to
/// `threads` threads without the GIL, and counted in `index`.
///
/// As puts in order would: a key given twice is written once, with its last value that fits
/// the budget; room is made before anything is written (the evicted values' files are
/// deleted), so the budget holds on disk while the batch is written; a value evicted by a later
/// one of the batch leaves no file. A write that fails leaves the old value, counted again.
#[pyfunction]
#[pyo3(signature = (root, keys, heads, payloads, index, tmp_tag, *, fsync = false, threads = 1))]
#[allow(clippy::too_many_arguments)] // the store's state, passed in from Python
pub fn write_stored(
    py: Python<'_>,
    root: &str,
    keys: Vec<String>,
    heads: Vec<Vec<u8>>,
    payloads: Vec<Bound<'_, PyAny>>,
    index: &Bound<'_, PyStoreIndex>,
    tmp_tag: &str,
    fsync: bool,
    threads: usize,
) -> PyResult<Stored> {
    check_lengths(
        keys.len(),
        &[("heads", heads.len()), ("payloads", payloads.len())],
    )?;
    let arrays: Vec<PyReadonlyArray1<'_, u8>> = crate::checksum::byte_arrays(&payloads)?;
    let bodies = crate::checksum::byte_slices(&arrays)?;
    let sizes: Vec<u64> = heads
        .iter()
        .zip(&bodies)
        .map(|(h, b)| (h.len() + b.len() + 8) as u64)
        .collect();
    let index = index.get();
    let budget = index.lock().budget();
    let last: HashMap<&str, usize> = (0..keys.len())
        .filter(|&i| sizes[i] <= budget)
        .map(|i| (keys[i].as_str(), i))
        .collect();
    let at: Vec<usize> = (0..keys.len())
        .filter(|&i| last.get(keys[i].as_str()) == Some(&i))
        .collect();
    let paths = at
        .iter()
        .map(|&i| path_of(root, &keys[i]))
        .collect::<PyResult<Vec<_>>>()?;
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
    let heads: Vec<&[u8]> = at.iter().map(|&i| heads[i].as_slice()).collect();
    let bodies: Vec<&[u8]> = at.iter().map(|&i| bodies[i]).collect();
    let written = py.detach(|| {
        for victim in &victims {
            let _ = std::fs::remove_file(victim);
        }
        write_batch(&tmps, &paths, &heads, &bodies, fsync, threads, true)
    });
    let mut evicted = victims.len();
    let mut stored = vec![false; keys.len()];
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
                failures.push((i, PyErr::from(e).into_value(py).into_any()));
            }
        }
    }
    let done = (0..keys.len())
        .map(|i| sizes[i] <= budget && stored[last[keys[i].as_str()]])
        .collect();
    Ok((done, failures, evicted))
}
