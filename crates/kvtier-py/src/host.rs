//! `kvtier._core.HostValues`: the values of a host store, so that a put or a get is one call.
//!
//! A put turns its keys into stored keys, seals each value (header, payload, a zero checksum:
//! host values never leave the process) into a new `bytes` (or the caller's pinned buffer) with
//! one copy, admits it to the store's `StoreIndex` (evicting under its policy) and counts it;
//! a get checks each value's header against the key and namespace it is read under and hands
//! out a read-only view of its payload. The layout is `kvtier.stores.format`'s, written here
//! and checked by `sealed::check`, as for every store.
//!
//! Nothing that can call into Python (a conversion, an allocation, a release) runs while the
//! values' lock is held: another thread holding the GIL could wait on that lock forever.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::{PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyInt, PyList, PyMemoryView, PySlice, PyString};

use crate::arrays::{bytes_array, wrap_bytes};
use crate::sealed::{self, Expected};
use crate::store_index::PyStoreIndex;
use crate::store_stats::{PyStoreStats, StoreCounts};

const MAGIC: &[u8; 4] = b"KVTR";
const FORMAT_VERSION: u16 = 1;
/// Magic, version, header length, payload length, namespace digest.
const FIXED: usize = 24;
/// The trailing checksum field (0 here: never verified).
const SUM: usize = 8;
/// The longest key text a stored key may add to its namespace's prefix.
const KEY_TEXT_MAX: usize = 200;

/// `kvtier.stores.format.payload_view` and `kvtier.errors.InvalidArgumentError`, looked up once.
static PAYLOAD_VIEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static INVALID_ARGUMENT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static STORE_CLOSED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn invalid_argument(py: Python<'_>, message: String) -> PyErr {
    python_error(
        &INVALID_ARGUMENT,
        py,
        "kvtier.errors",
        "InvalidArgumentError",
        message,
    )
}

/// An instance of the Python exception class `module.name` (looked up once into `class`).
fn python_error(
    class: &PyOnceLock<Py<PyAny>>,
    py: Python<'_>,
    module: &str,
    name: &str,
    message: String,
) -> PyErr {
    match class
        .import(py, module, name)
        .and_then(|class| class.call1((message,)))
    {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// What one namespace writes into a value's header and checks on reading it: the prefix of
/// its stored keys, its digest and its texts after the key (codec, dtype, shape), with the
/// `kvtier.stores.Namespace` itself for keys of other types than `str` and `int`.
#[pyclass(name = "HeaderSpec", module = "kvtier._core", frozen)]
pub struct PyHeaderSpec {
    prefix: String,
    digest: u64,
    texts: Vec<u8>,
    namespace: Py<PyAny>,
}

#[pymethods]
impl PyHeaderSpec {
    #[new]
    fn new(namespace: Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyHeaderSpec {
            prefix: namespace.getattr("prefix")?.extract()?,
            digest: namespace.getattr("digest")?.extract()?,
            texts: namespace.getattr("packed_texts")?.extract()?,
            namespace: namespace.unbind(),
        })
    }
}

impl PyHeaderSpec {
    /// The stored key of `key`, as `Namespace.key` makes it: a text key of printable ASCII
    /// without spaces, or a 64-bit hash as 16 hex digits; other types go to `Namespace.key`.
    fn key(&self, key: &Bound<'_, PyAny>) -> PyResult<String> {
        if let Ok(text) = key.cast_exact::<PyString>() {
            let text = text.to_str()?;
            let ok = (1..=KEY_TEXT_MAX).contains(&text.len())
                && text.bytes().all(|c| (0x21..=0x7e).contains(&c));
            if ok {
                return Ok(self.prefixed(text.as_bytes()));
            }
        } else if let Ok(int) = key.cast_exact::<PyInt>() {
            if let Ok(hash) = int.extract::<u64>() {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let digits: [u8; 16] =
                    std::array::from_fn(|i| HEX[(hash >> (60 - 4 * i)) as usize & 15]);
                return Ok(self.prefixed(&digits));
            }
        }
        // Bad text, a negative or wide int, numpy ints, anything else: the Python rules (and
        // their messages) decide.
        self.namespace
            .bind(key.py())
            .call_method1("key", (key,))?
            .extract()
    }

    /// The prefix and then `text` (printable ASCII), in one allocation: `format!` costs a
    /// tenth of a small get.
    fn prefixed(&self, text: &[u8]) -> String {
        let mut key = String::with_capacity(self.prefix.len() + text.len());
        key.push_str(&self.prefix);
        key.extend(text.iter().map(|&c| c as char));
        key
    }

    /// The header texts of a value stored under `key` (the key's, then the namespace's).
    fn texts(&self, key: &str) -> Vec<u8> {
        let mut texts = Vec::with_capacity(2 + key.len() + self.texts.len());
        texts.extend_from_slice(&(key.len() as u16).to_le_bytes());
        texts.extend_from_slice(key.as_bytes());
        texts.extend_from_slice(&self.texts);
        texts
    }
}

/// The bytes of a value to store: a `bytes` as it is, a `bytearray`, contiguous `memoryview`
/// or uint8 array wrapped without a copy, anything else (other dtypes, CPU tensors) through
/// `format.payload_view`, which also refuses what is not a contiguous buffer.
fn payload<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bytes<'py>> {
    if let Ok(b) = value.cast_exact::<PyBytes>() {
        return Ok(Bytes::Bytes(b.clone()));
    }
    if let Some(a) = wrap_bytes(value) {
        return Ok(Bytes::Array(a));
    }
    if let Ok(a) = value.extract::<PyReadonlyArray1<'py, u8>>() {
        if a.is_contiguous() {
            return Ok(Bytes::Array(a));
        }
    }
    let view = PAYLOAD_VIEW
        .import(value.py(), "kvtier.stores.format", "payload_view")?
        .call1((value,))?;
    Ok(Bytes::Array(bytes_array(&view, "value")?))
}

/// Bytes held by Python: a `bytes` (stored values and the commonest payload), or a uint8 array
/// (any other buffer, wrapped; pinned stored values).
enum Bytes<'py> {
    Bytes(Bound<'py, PyBytes>),
    Array(PyReadonlyArray1<'py, u8>),
}

impl Bytes<'_> {
    fn as_slice(&self) -> PyResult<&[u8]> {
        match self {
            Bytes::Bytes(b) => Ok(b.as_bytes()),
            Bytes::Array(a) => Ok(a.as_slice()?),
        }
    }
}

/// A sealed value in a new `bytes`: header, payload and a zero checksum, in one copy.
fn seal<'py>(
    py: Python<'py>,
    spec: &PyHeaderSpec,
    key: &str,
    payload: &[u8],
) -> PyResult<Bound<'py, PyAny>> {
    let head = FIXED + 2 + key.len() + spec.texts.len();
    let size = head + payload.len() + SUM;
    // SAFETY: `PyBytes_FromStringAndSize(NULL, n)` returns a new bytes object of `n`
    // uninitialised bytes (or NULL with an exception set); nothing else sees it before every
    // byte is written below, as the C API allows for a bytes object just made.
    unsafe {
        let raw = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), size as isize);
        let bytes = Bound::from_owned_ptr_or_err(py, raw)?;
        let out = std::slice::from_raw_parts_mut(
            pyo3::ffi::PyBytes_AsString(bytes.as_ptr()).cast::<u8>(),
            size,
        );
        write_sealed(out, spec, key, payload, head);
        Ok(bytes)
    }
}

/// The sealed value into `out` (exactly its size), the header `head` bytes long.
fn write_sealed(out: &mut [u8], spec: &PyHeaderSpec, key: &str, payload: &[u8], head: usize) {
    out[..4].copy_from_slice(MAGIC);
    out[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[6..8].copy_from_slice(&(head as u16).to_le_bytes());
    out[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[16..24].copy_from_slice(&spec.digest.to_le_bytes());
    out[24..26].copy_from_slice(&(key.len() as u16).to_le_bytes());
    out[26..26 + key.len()].copy_from_slice(key.as_bytes());
    out[26 + key.len()..head].copy_from_slice(&spec.texts);
    out[head..head + payload.len()].copy_from_slice(payload);
    out[head + payload.len()..].fill(0);
}

/// A sealed value in a buffer from `alloc(size)` (a uint8 array, e.g. pinned memory).
fn seal_into<'py>(
    alloc: &Bound<'py, PyAny>,
    spec: &PyHeaderSpec,
    key: &str,
    payload: &[u8],
) -> PyResult<Bound<'py, PyAny>> {
    let head = FIXED + 2 + key.len() + spec.texts.len();
    let size = head + payload.len() + SUM;
    let buf = alloc.call1((size,))?;
    {
        let array = buf.cast::<numpy::PyArray1<u8>>()?;
        let mut rw = array.readwrite();
        let out = rw.as_slice_mut()?;
        let out = out
            .get_mut(..size)
            .ok_or_else(|| invalid_argument(alloc.py(), format!("alloc({size}) is too short")))?;
        write_sealed(out, spec, key, payload, head);
    }
    Ok(buf)
}

/// The bytes of a stored value (a `bytes`, or a uint8 array from `alloc`).
fn stored_bytes<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bytes<'py>> {
    match value.cast_exact::<PyBytes>() {
        Ok(b) => Ok(Bytes::Bytes(b.clone())),
        Err(_) => Ok(Bytes::Array(value.extract()?)),
    }
}

/// The values of a host store by stored key, and its index (budget and eviction order).
#[pyclass(name = "HostValues", module = "kvtier._core", frozen)]
pub struct PyHostValues {
    index: Py<PyStoreIndex>,
    counts: Arc<StoreCounts>,
    values: Mutex<HashMap<String, Py<PyAny>>>,
    closed: AtomicBool,
}

impl PyHostValues {
    /// Raises `kvtier.stores.StoreClosedError` once the store is closed (checked here, not in
    /// Python: it is a tenth of a small get).
    fn check_open(&self, py: Python<'_>) -> PyResult<()> {
        if !self.closed.load(Relaxed) {
            return Ok(());
        }
        let message = "host store: the store is closed; open a new one".to_owned();
        Err(python_error(
            &STORE_CLOSED,
            py,
            "kvtier.stores.base",
            "StoreClosedError",
            message,
        ))
    }

    fn values(&self) -> MutexGuard<'_, HashMap<String, Py<PyAny>>> {
        self.values.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The payload of `value` stored under `key` as a read-only view, after its header checks;
    /// else why it fails them.
    fn checked_view<'py>(
        spec: &PyHeaderSpec,
        key: &str,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Result<Bound<'py, PyAny>, String>> {
        let bytes = stored_bytes(value)?;
        let texts = spec.texts(key);
        let want = Expected {
            digest: spec.digest,
            texts: &texts,
        };
        let (start, stop) = match sealed::check(bytes.as_slice()?, None, &want, false) {
            Ok(span) => span,
            Err(reason) => return Ok(Err(reason)),
        };
        let py = value.py();
        let view = PyMemoryView::from(value)?;
        let view = view.get_item(PySlice::new(py, start as isize, stop as isize, 1))?;
        match bytes {
            Bytes::Bytes(_) => Ok(Ok(view)), // a view of bytes is read-only
            Bytes::Array(_) => Ok(Ok(view.call_method0("toreadonly")?)),
        }
    }

    /// What a get hands out for `value` found (or not) under `key`: its checked payload, or
    /// None; a value that fails a check is removed and reported to `on_corrupt`. Returns the
    /// result, with the payload bytes of a hit and whether the value was corrupt.
    fn serve<'py>(
        &self,
        spec: &PyHeaderSpec,
        key: &str,
        value: Option<Bound<'py, PyAny>>,
        on_corrupt: &Bound<'py, PyAny>,
    ) -> PyResult<Served<'py>> {
        let py = on_corrupt.py();
        let Some(value) = value else {
            return Ok(Served::Miss(py.None().into_bound(py)));
        };
        match Self::checked_view(spec, key, &value)? {
            Ok(view) => {
                let n = view.len()? as u64;
                Ok(Served::Hit(view, n))
            }
            Err(reason) => {
                let gone = self.values().remove(key);
                self.index.get().lock().remove(key);
                drop(gone);
                on_corrupt.call1((key, reason))?;
                Ok(Served::Corrupt(py.None().into_bound(py)))
            }
        }
    }

    /// `serve` for a read of one key, counted.
    fn serve_one<'py>(
        &self,
        spec: &PyHeaderSpec,
        key: &str,
        value: Option<Bound<'py, PyAny>>,
        on_corrupt: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self.serve(spec, key, value, on_corrupt)? {
            Served::Hit(view, n) => {
                self.counts.count_gets(1, n, 0, 0);
                view
            }
            Served::Corrupt(none) => {
                self.counts.count_gets(0, 0, 1, 1);
                none
            }
            Served::Miss(none) => {
                self.counts.count_gets(0, 0, 1, 0);
                none
            }
        })
    }

    /// Admits a sealed value under its stored key, replacing what the key held and evicting
    /// what the index says; returns whether it was stored (not: larger than the whole budget)
    /// and how many values it evicted. What leaves is released after the lock.
    fn admit(&self, key: String, value: Bound<'_, PyAny>) -> PyResult<(bool, u64)> {
        let size = value.len()? as u64;
        let mut released = Vec::new();
        let admitted = {
            let mut values = self.values();
            let mut index = self.index.get().lock();
            index.admit(&key, size).map(|victims| {
                released.extend(victims.iter().filter_map(|v| values.remove(v)));
                released.extend(values.insert(key, value.clone().unbind()));
                victims.len() as u64
            })
        };
        drop(released);
        Ok(admitted.map_or((false, 0), |evicted| (true, evicted)))
    }

    /// Seals and admits each value in turn, so that what a value replaces is released before
    /// the next is sealed (a batch of large values then needs no room for two copies of it);
    /// counts the batch.
    fn store<'py>(
        &self,
        py: Python<'py>,
        spec: &PyHeaderSpec,
        checked: Vec<(String, Bytes<'py>)>,
        alloc: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<bool>> {
        let mut done = Vec::with_capacity(checked.len());
        let (mut stored_bytes, mut evicted) = (0, 0);
        for (key, payload) in checked {
            let bytes = payload.as_slice()?;
            let sealed = match alloc {
                None => seal(py, spec, &key, bytes)?,
                Some(alloc) => seal_into(alloc, spec, &key, bytes)?,
            };
            let (stored, gone) = self.admit(key, sealed)?;
            if stored {
                stored_bytes += bytes.len() as u64;
            }
            evicted += gone;
            done.push(stored);
        }
        let stored = done.iter().filter(|&&d| d).count() as u64;
        self.counts
            .count_puts(stored, stored_bytes, done.len() as u64 - stored);
        self.counts.evictions.fetch_add(evicted, Relaxed);
        Ok(done)
    }
}

/// A get's result for one key.
enum Served<'py> {
    Miss(Bound<'py, PyAny>),
    Hit(Bound<'py, PyAny>, u64),
    Corrupt(Bound<'py, PyAny>),
}

#[pymethods]
impl PyHostValues {
    /// Values indexed by `index` (the store's budget and policy), counted into `stats`.
    #[new]
    fn new(index: Py<PyStoreIndex>, stats: &PyStoreStats) -> Self {
        PyHostValues {
            index,
            counts: Arc::clone(&stats.counts),
            values: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        }
    }

    /// Stores each value under its key of `spec`'s namespace; returns which were stored
    /// (False: larger than the whole budget). `alloc(size)` gives the buffer a value is sealed
    /// into (None: a new `bytes`). A bad key or value raises before anything is stored.
    #[pyo3(signature = (spec, keys, values, alloc = None))]
    fn put_many(
        &self,
        py: Python<'_>,
        spec: &PyHeaderSpec,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        alloc: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<bool>> {
        self.check_open(py)?;
        let (n, m) = (keys.len()?, values.len()?);
        if n != m {
            return Err(invalid_argument(
                py,
                format!("put_many: {n} keys but {m} values; expected one value per key"),
            ));
        }
        // Every key and value is checked before anything is sealed or stored.
        let mut checked = Vec::with_capacity(n);
        for (key, value) in keys.try_iter()?.zip(values.try_iter()?) {
            checked.push((spec.key(&key?)?, payload(&value?)?));
        }
        self.store(py, spec, checked, alloc)
    }

    /// `put_many` of one value.
    #[pyo3(signature = (spec, key, value, alloc = None))]
    fn put(
        &self,
        py: Python<'_>,
        spec: &PyHeaderSpec,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        alloc: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.check_open(py)?;
        let checked = vec![(spec.key(key)?, payload(value)?)];
        Ok(self.store(py, spec, checked, alloc)?[0])
    }

    /// The payloads under `keys` of `spec`'s namespace, as read-only views; None for a miss.
    /// A value that fails a check is a miss, removed and counted, and `on_corrupt(key,
    /// reason)` is called for it.
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        spec: &PyHeaderSpec,
        keys: &Bound<'py, PyAny>,
        on_corrupt: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.check_open(py)?;
        let full = keys
            .try_iter()?
            .map(|k| spec.key(&k?))
            .collect::<PyResult<Vec<String>>>()?;
        let found: Vec<Option<Bound<'py, PyAny>>> = {
            let values = self.values();
            full.iter()
                .map(|k| values.get(k).map(|v| v.bind(py).clone()))
                .collect()
        };
        let hit_keys: Vec<&String> = full
            .iter()
            .zip(&found)
            .filter_map(|(k, f)| f.as_ref().map(|_| k))
            .collect();
        self.index.get().lock().touch(&hit_keys);
        let out = PyList::empty(py);
        let (mut hits, mut hit_bytes, mut corrupt) = (0, 0, 0);
        for (key, value) in full.iter().zip(found) {
            out.append(match self.serve(spec, key, value, on_corrupt)? {
                Served::Hit(view, n) => {
                    (hits, hit_bytes) = (hits + 1, hit_bytes + n);
                    view
                }
                Served::Corrupt(none) => {
                    corrupt += 1;
                    none
                }
                Served::Miss(none) => none,
            })?;
        }
        self.counts
            .count_gets(hits, hit_bytes, full.len() as u64 - hits, corrupt);
        Ok(out)
    }

    /// `get_many` of one key.
    fn get<'py>(
        &self,
        py: Python<'py>,
        spec: &PyHeaderSpec,
        key: &Bound<'py, PyAny>,
        on_corrupt: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_open(py)?;
        let full = spec.key(key)?;
        let value = self.values().get(&full).map(|v| v.bind(py).clone());
        if value.is_some() {
            self.index.get().lock().touch(&[&full]);
        }
        self.serve_one(spec, &full, value, on_corrupt)
    }

    /// Takes the value out and returns its payload (checked, as for `get`); None for a miss.
    fn pop<'py>(
        &self,
        py: Python<'py>,
        spec: &PyHeaderSpec,
        key: &Bound<'py, PyAny>,
        on_corrupt: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_open(py)?;
        let full = spec.key(key)?;
        let value = self.values().remove(&full).map(|v| v.into_bound(py));
        self.index.get().lock().remove(&full);
        self.serve_one(spec, &full, value, on_corrupt)
    }

    /// Whether a value is stored under `key` of `spec`'s namespace.
    fn contains(&self, spec: &PyHeaderSpec, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.check_open(key.py())?;
        let full = spec.key(key)?;
        Ok(self.values().contains_key(&full))
    }

    /// Deletes the values under `keys`; returns which there were.
    fn delete_many(&self, spec: &PyHeaderSpec, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.check_open(keys.py())?;
        let full = keys
            .try_iter()?
            .map(|k| spec.key(&k?))
            .collect::<PyResult<Vec<String>>>()?;
        let gone: Vec<Option<Py<PyAny>>> = {
            let mut values = self.values();
            full.iter().map(|k| values.remove(k)).collect()
        };
        let mut index = self.index.get().lock();
        for key in &full {
            index.remove(key);
        }
        drop(index);
        let done: Vec<bool> = gone.iter().map(Option::is_some).collect();
        drop(gone); // released with the locks given back
        let deleted = done.iter().filter(|&&d| d).count() as u64;
        self.counts.deletes.fetch_add(deleted, Relaxed);
        Ok(done)
    }

    /// The stored keys that start with `prefix`.
    fn scan(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
        self.check_open(py)?;
        Ok(self
            .values()
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect())
    }

    /// Closes the store: every call after this raises `StoreClosedError`, and every value is
    /// dropped.
    fn close(&self) {
        self.closed.store(true, Relaxed);
        let values = std::mem::take(&mut *self.values());
        let mut index = self.index.get().lock();
        for key in values.keys() {
            index.remove(key);
        }
        drop(index);
        drop(values);
    }

    fn __len__(&self) -> usize {
        self.values().len()
    }
}
