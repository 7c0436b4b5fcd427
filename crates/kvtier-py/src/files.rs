//! `kvtier._core`'s file functions (`kvtier.stores.DiskStore`'s batches): Python arguments in,
//! `kvtier_store::files` run without the GIL, results out as Python objects (a payload as a
//! read-only memoryview, a `PayloadError`, an `OSError`).

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use kvtier_store::files::{self, Put, Read, Write};

use crate::errors::IntoPy as _;
use crate::sealed::payload_error;
use crate::store_index::PyStoreIndex;

/// A read as Python gets it: the payload as a read-only memoryview (over the numpy array that
/// owns the bytes read), the `PayloadError` of a value that failed a check, the `OSError`, or
/// None (no file, where that is a miss).
fn served(py: Python<'_>, read: Read) -> PyResult<Py<PyAny>> {
    Ok(match read {
        Read::Value { data, payload } => {
            let array = numpy::PyArray1::from_vec(py, data);
            crate::sealed::read_only_span(array.as_any(), payload.start, payload.end, true, false)?
                .unbind()
        }
        Read::Refused(reason) => payload_error(py, &reason).into_value(py).into_any(),
        Read::Missing => py.None(),
        Read::Failed(e) => PyErr::from(e).into_value(py).into_any(),
    })
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
    check_lengths(paths.len(), &[("texts", texts.len())])?;
    let reads: Vec<(&str, &[u8])> = paths
        .iter()
        .zip(&texts)
        .map(|(p, t)| (p.as_str(), t.as_slice()))
        .collect();
    let read = py.detach(|| files::read_sealed(&reads, digest, threads));
    read.into_iter().map(|r| served(py, r)).collect()
}

/// Where the disk store at `root` keeps the value under the store key `key`
/// (`kvtier:<namespace digest>:<name>`): `<root>/<namespace digest>/<xx>/<name>`, `xx` the low
/// byte of the key's xxh3-64 in hex (256 directories a namespace), and `~` and the whole
/// xxh3-64 in hex in place of a name that is not a safe file name (the header inside names the
/// key either way).
#[pyfunction]
pub fn store_path(root: &str, key: &str) -> PyResult<String> {
    files::store_path(root, key).py_err()
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
    let index = &index.get().inner;
    let read = py
        .detach(|| files::read_stored(root, &keys, digest, texts, index, threads))
        .py_err()?;
    read.into_iter().map(|r| served(py, r)).collect()
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
    let writes: Vec<Write<'_>> = (0..tmp_paths.len())
        .map(|i| Write {
            tmp: &tmp_paths[i],
            path: &paths[i],
            head: &heads[i],
            payload: bodies[i],
        })
        .collect();
    let written = py.detach(|| files::write_checksummed(&writes, fsync, threads));
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
    let puts: Vec<Put<'_>> = (0..keys.len())
        .map(|i| Put {
            key: &keys[i],
            head: &heads[i],
            payload: bodies[i],
        })
        .collect();
    let index = &index.get().inner;
    let stored = py
        .detach(|| files::write_stored(root, &puts, index, tmp_tag, fsync, threads))
        .py_err()?;
    let failures = stored
        .failures
        .into_iter()
        .map(|(i, e)| (i, PyErr::from(e).into_value(py).into_any()))
        .collect();
    Ok((stored.done, failures, stored.evicted))
}
