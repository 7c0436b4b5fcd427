//! `kvtier._core.HostValues`: the values of a host store, so that a put or a get is one call.
//!
//! A put turns its keys into stored keys, seals each value (header, payload, a zero checksum:
//! host values never leave the process) into a `HostValue` with one copy (into memory of its
//! own, or the caller's pinned buffer), admits it to the store's `StoreIndex` (evicting under
//! its policy) and counts it; a get checks each value's header against the key and namespace
//! it is read under and hands out a memoryview of the `HostValue`, whose buffer is exactly its
//! payload, read-only (one new object a get). The layout is `kvtier.stores.format`'s, written
//! here and checked by `sealed::check`, as for every store.
//!
//! A `HostValues` is one namespace's handle on the values (with the store's callback for a
//! value that fails its checks), so the store's public methods can be its methods, with no
//! Python in between; `view` gives another namespace's handle on the same values.
//!
//! Nothing that can call into Python (a conversion, an allocation, a release) runs while the
//! values' lock is held: another thread holding the GIL could wait on that lock forever.

use std::ffi::{c_int, c_void};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::PyArrayMethods;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::gc::{PyTraverseError, PyVisit};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyString};

use crate::arrays::{contiguous_buffer, Bytes};
use crate::sealed::{self, Expected, FIXED, FORMAT_VERSION, MAGIC, SUM};
use crate::store_index::PyStoreIndex;
use crate::store_stats::{PyStoreStats, StoreCounts};

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
struct HeaderSpec {
    prefix: String,
    digest: u64,
    texts: Vec<u8>,
    namespace: Py<PyAny>,
}

impl HeaderSpec {
    fn new(namespace: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(HeaderSpec {
            prefix: namespace.getattr("prefix")?.extract()?,
            digest: namespace.getattr("digest")?.extract()?,
            texts: namespace.getattr("packed_texts")?.extract()?,
            namespace: namespace.clone().unbind(),
        })
    }

    /// The stored key of `key`, as `Namespace.key` makes it: a text key of printable ASCII
    /// without spaces, or a 64-bit hash as 16 hex digits; other types go to `Namespace.key`.
    fn key(&self, key: &Bound<'_, PyAny>) -> PyResult<String> {
        self.with_key(key, str::to_owned)
    }

    /// `f` of the stored key of `key` (see `key`), built on the stack where it can be: a get
    /// needs the key only to look it up, and allocating it cost a tenth of a small get.
    fn with_key<R>(&self, key: &Bound<'_, PyAny>, f: impl FnOnce(&str) -> R) -> PyResult<R> {
        let digits: [u8; 16];
        let text: &[u8] = if let Ok(text) = key.cast_exact::<PyString>() {
            let text = text.to_str()?.as_bytes();
            let ok = (1..=KEY_TEXT_MAX).contains(&text.len())
                && text.iter().all(|c| (0x21..=0x7e).contains(c));
            if !ok {
                return self.python_key(key).map(|k| f(&k));
            }
            text
        } else if let Some(hash) = key
            .cast_exact::<PyInt>()
            .ok()
            .and_then(|int| int.extract::<u64>().ok())
        {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            digits = std::array::from_fn(|i| HEX[(hash >> (60 - 4 * i)) as usize & 15]);
            &digits
        } else {
            return self.python_key(key).map(|k| f(&k));
        };
        // Prefixes are 24 bytes (kvtier:<16 hex digits>:), texts at most KEY_TEXT_MAX.
        let mut buf = [0u8; 256];
        let n = self.prefix.len() + text.len();
        if n > buf.len() {
            return self.python_key(key).map(|k| f(&k));
        }
        buf[..self.prefix.len()].copy_from_slice(self.prefix.as_bytes());
        buf[self.prefix.len()..n].copy_from_slice(text);
        // Printable ASCII, the prefix (kvtier:<hex>:) and the text alike.
        Ok(f(
            std::str::from_utf8(&buf[..n]).expect("stored keys are ASCII")
        ))
    }

    /// The stored key of a key only the Python rules (and their messages) decide on: bad
    /// text, a negative or wide int, numpy ints, anything else.
    fn python_key(&self, key: &Bound<'_, PyAny>) -> PyResult<String> {
        self.namespace
            .bind(key.py())
            .call_method1("key", (key,))?
            .extract()
    }

    /// The length of the header of a value stored under `key`.
    fn header_len(&self, key: &str) -> usize {
        FIXED + 2 + key.len() + self.texts.len()
    }

    /// Appends to `head` the header of a value of `length` payload bytes stored under `key`.
    fn write_header(&self, head: &mut Vec<u8>, key: &str, length: usize) {
        let size = self.header_len(key);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        head.extend_from_slice(&(size as u16).to_le_bytes());
        head.extend_from_slice(&(length as u64).to_le_bytes());
        head.extend_from_slice(&self.digest.to_le_bytes());
        head.extend_from_slice(&(key.len() as u16).to_le_bytes());
        head.extend_from_slice(key.as_bytes());
        head.extend_from_slice(&self.texts);
    }

    /// The payload's span in `sealed`, a value read under `key`, once its header checks pass;
    /// else why they fail.
    fn check(&self, key: &str, sealed: &[u8]) -> Result<(usize, usize), String> {
        let key_len = (key.len() as u16).to_le_bytes();
        let want = Expected {
            digest: self.digest,
            texts: &[&key_len, key.as_bytes(), &self.texts],
        };
        sealed::check(sealed, None, &want, false)
    }
}

/// The bytes of a value to store: a `bytes` as it is; a `bytearray`, `memoryview` or numpy array
/// through the buffer protocol when it is C-contiguous (its bytes, whatever their format), without
/// a copy; anything else (CPU tensors, strided views) through `format.payload_view`, which also
/// refuses what is not a contiguous buffer.
fn payload<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bytes<'py>> {
    if let Ok(b) = value.cast_exact::<PyBytes>() {
        return Ok(Bytes::Bytes(b.clone()));
    }
    let buffer_like = value.is_instance_of::<PyMemoryView>()
        || value.is_instance_of::<PyByteArray>()
        || value.is_instance_of::<numpy::PyUntypedArray>();
    if buffer_like {
        if let Some(buffer) = contiguous_buffer(value) {
            return Ok(Bytes::Buffer(buffer));
        }
    }
    let view = PAYLOAD_VIEW
        .import(value.py(), "kvtier.stores.format", "payload_view")?
        .call1((value,))?;
    contiguous_buffer(&view)
        .map(Bytes::Buffer)
        .ok_or_else(|| invalid_argument(value.py(), "value: expected a contiguous buffer".into()))
}

/// A value a host store holds, sealed (header, payload, checksum field). Its buffer is its
/// payload, read-only: a get hands out `memoryview(value)`.
#[pyclass(name = "HostValue", module = "kvtier._core", frozen)]
pub struct HostValue {
    memory: Memory,
    /// Where the payload starts: the header's length.
    head: usize,
}

/// Where a sealed value lives: memory of its own, or a buffer from the store's `alloc` (pinned
/// memory), held here, with the address and length of the bytes it was sealed into.
enum Memory {
    Own(Box<[u8]>),
    Given {
        _buffer: Py<PyAny>,
        addr: usize,
        len: usize,
    },
}

impl HostValue {
    fn sealed(&self) -> &[u8] {
        match &self.memory {
            Memory::Own(bytes) => bytes,
            // SAFETY: `_buffer`, held as long as this value, owns these bytes; they were written
            // once, by the seal, and the store never hands the buffer out writable.
            Memory::Given { addr, len, .. } => unsafe {
                std::slice::from_raw_parts(*addr as *const u8, *len)
            },
        }
    }

    fn payload(&self) -> &[u8] {
        let sealed = self.sealed();
        &sealed[self.head..sealed.len() - SUM]
    }
}

#[pymethods]
impl HostValue {
    /// The payload, read-only (the buffer protocol): what `memoryview(value)` shows.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("a stored value is read-only"));
        }
        let payload = slf.get().payload();
        let (buf, len) = (payload.as_ptr().cast_mut().cast::<c_void>(), payload.len());
        let wanted = |flag: c_int| flags & flag == flag;
        // SAFETY: `view` is the caller's to fill, as the buffer protocol says; the bytes stay in
        // place while this value lives, and the view holds a reference to it (`obj`).
        unsafe {
            (*view).buf = buf;
            (*view).len = len as isize; // within an allocation, so within isize
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = if wanted(ffi::PyBUF_FORMAT) {
                c"B".as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if wanted(ffi::PyBUF_ND) {
                &raw mut (*view).len
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if wanted(ffi::PyBUF_STRIDES) {
                &raw mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    /// The payload's length in bytes.
    fn __len__(&self) -> usize {
        self.payload().len()
    }
}

type ValueMap = foldhash::HashMap<String, Py<HostValue>>;

/// What every namespace's handle on one host store's values shares.
struct Shared {
    index: Py<PyStoreIndex>,
    counts: Arc<StoreCounts>,
    values: Mutex<ValueMap>,
    closed: AtomicBool,
}

impl Shared {
    fn values(&self) -> MutexGuard<'_, ValueMap> {
        self.values.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One namespace's handle on the values of a host store, indexed by the store's `StoreIndex`
/// (budget and eviction order).
#[pyclass(name = "HostValues", module = "kvtier._core", frozen)]
pub struct PyHostValues {
    shared: Arc<Shared>,
    spec: HeaderSpec,
    /// Called as `on_corrupt(key, reason)` for a value that fails its checks.
    on_corrupt: Py<PyAny>,
    /// `alloc(size)` gives the buffer a value is sealed into (None: memory of its own).
    alloc: Option<Py<PyAny>>,
}

/// A get's result for one key.
enum Served<'py> {
    Miss,
    Hit(Bound<'py, PyAny>, u64),
    Corrupt,
}

impl PyHostValues {
    /// Raises `kvtier.stores.StoreClosedError` once the store is closed (checked here, not in
    /// Python: it is a tenth of a small get).
    fn check_open(&self, py: Python<'_>) -> PyResult<()> {
        if !self.shared.closed.load(Relaxed) {
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

    /// `payload` sealed under `key`, in one copy.
    fn seal(&self, py: Python<'_>, key: &str, payload: &[u8]) -> PyResult<Py<HostValue>> {
        let head_len = self.spec.header_len(key);
        let size = head_len + payload.len() + SUM;
        let memory = match &self.alloc {
            None => {
                let mut bytes = Vec::with_capacity(size);
                self.spec.write_header(&mut bytes, key, payload.len());
                bytes.extend_from_slice(payload);
                bytes.extend_from_slice(&[0; SUM]);
                Memory::Own(bytes.into_boxed_slice())
            }
            Some(alloc) => {
                let mut head = Vec::with_capacity(head_len);
                self.spec.write_header(&mut head, key, payload.len());
                let buffer = alloc.bind(py).call1((size,))?;
                let addr = {
                    let array = buffer.cast::<numpy::PyArray1<u8>>()?;
                    let mut rw = array.readwrite();
                    let out = rw.as_slice_mut()?.get_mut(..size).ok_or_else(|| {
                        invalid_argument(py, format!("alloc({size}) is too short"))
                    })?;
                    out[..head.len()].copy_from_slice(&head);
                    out[head.len()..size - SUM].copy_from_slice(payload);
                    out[size - SUM..].fill(0);
                    out.as_ptr() as usize
                };
                Memory::Given {
                    _buffer: buffer.unbind(),
                    addr,
                    len: size,
                }
            }
        };
        Py::new(
            py,
            HostValue {
                memory,
                head: head_len,
            },
        )
    }

    /// What a get hands out for `value` found (or not) under `key`: a view of its payload once
    /// its header checks pass; a value that fails them is removed and reported to `on_corrupt`.
    fn serve<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        value: Option<Py<HostValue>>,
    ) -> PyResult<Served<'py>> {
        let Some(value) = value else {
            return Ok(Served::Miss);
        };
        match self.spec.check(key, value.get().sealed()) {
            Ok((start, stop)) => {
                let view = PyMemoryView::from(value.bind(py).as_any())?.into_any();
                Ok(Served::Hit(view, (stop - start) as u64))
            }
            Err(reason) => {
                let gone = self.shared.values().remove(key);
                self.shared.index.get().lock().remove(key);
                drop((gone, value));
                self.on_corrupt.bind(py).call1((key, reason))?;
                Ok(Served::Corrupt)
            }
        }
    }

    /// `serve` for a read of one key, counted.
    fn serve_one<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        value: Option<Py<HostValue>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (hits, bytes, corrupt) = match self.serve(py, key, value)? {
            Served::Hit(view, n) => {
                self.shared.counts.count_gets(1, n, 0, 0);
                return Ok(view);
            }
            Served::Corrupt => (0, 0, 1),
            Served::Miss => (0, 0, 0),
        };
        self.shared.counts.count_gets(hits, bytes, 1, corrupt);
        Ok(py.None().into_bound(py))
    }

    /// Admits a sealed value under its stored key, replacing what the key held and evicting
    /// what the index says; returns whether it was stored (not: larger than the whole budget)
    /// and how many values it evicted. What leaves is released after the lock.
    fn admit(&self, key: String, value: Py<HostValue>) -> (bool, u64) {
        let size = value.get().sealed().len() as u64;
        let mut values = self.shared.values();
        // A put that passed its open check while `close` ran: `close` marks the store closed
        // before it empties the map, so under the map's lock this sees it and refuses (else
        // the value would stay in a closed store's map).
        if self.shared.closed.load(Relaxed) {
            drop(values);
            return (false, 0);
        }
        let mut index = self.shared.index.get().lock();
        let Some(victims) = index.admit(&key, size) else {
            drop((index, values));
            return (false, 0); // `value` is released here, after the locks
        };
        let evicted: Vec<_> = victims.iter().filter_map(|v| values.remove(v)).collect();
        let replaced = values.insert(key, value);
        drop((index, values));
        drop((evicted, replaced));
        (true, victims.len() as u64)
    }

    /// Seals and admits each value in turn, so that what a value replaces is released before
    /// the next is sealed (a batch of large values then needs no room for two copies of it);
    /// counts the batch.
    fn store(&self, py: Python<'_>, checked: Vec<(String, Bytes<'_>)>) -> PyResult<Vec<bool>> {
        let mut done = Vec::with_capacity(checked.len());
        let (mut stored_bytes, mut evicted) = (0, 0);
        for (key, payload) in checked {
            let bytes = payload.as_slice();
            let sealed = self.seal(py, &key, bytes)?;
            let (stored, gone) = self.admit(key, sealed);
            if stored {
                stored_bytes += bytes.len() as u64;
            }
            evicted += gone;
            done.push(stored);
        }
        let stored = done.iter().filter(|&&d| d).count() as u64;
        self.count_puts(stored, stored_bytes, done.len() as u64 - stored, evicted);
        Ok(done)
    }

    fn count_puts(&self, stored: u64, stored_bytes: u64, refused: u64, evicted: u64) {
        let counts = &self.shared.counts;
        counts.count_puts(stored, stored_bytes, refused);
        counts.evictions.fetch_add(evicted, Relaxed);
    }

    fn keys_of(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        keys.try_iter()?.map(|k| self.spec.key(&k?)).collect()
    }
}

#[pymethods]
impl PyHostValues {
    /// `namespace`'s handle on new values indexed by `index` (the store's budget and policy),
    /// counted into `stats`; `on_corrupt(key, reason)` hears of a value that fails its checks,
    /// `alloc(size)` gives the buffer a value is sealed into (None: memory of its own).
    #[new]
    #[pyo3(signature = (index, stats, namespace, on_corrupt, alloc = None))]
    fn new(
        index: Py<PyStoreIndex>,
        stats: &PyStoreStats,
        namespace: &Bound<'_, PyAny>,
        on_corrupt: Py<PyAny>,
        alloc: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let shared = Shared {
            index,
            counts: Arc::clone(&stats.counts),
            values: Mutex::new(ValueMap::default()),
            closed: AtomicBool::new(false),
        };
        Ok(PyHostValues {
            shared: Arc::new(shared),
            spec: HeaderSpec::new(namespace)?,
            on_corrupt,
            alloc,
        })
    }

    /// `namespace`'s handle on the same values (same budget, index and counters).
    fn view(
        &self,
        py: Python<'_>,
        namespace: &Bound<'_, PyAny>,
        on_corrupt: Py<PyAny>,
    ) -> PyResult<Self> {
        Ok(PyHostValues {
            shared: Arc::clone(&self.shared),
            spec: HeaderSpec::new(namespace)?,
            on_corrupt,
            alloc: self.alloc.as_ref().map(|a| a.clone_ref(py)),
        })
    }

    /// Stores each value under its key; returns which were stored (False: larger than the
    /// whole budget). A bad key or value raises before anything is stored.
    fn put_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
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
            checked.push((self.spec.key(&key?)?, payload(&value?)?));
        }
        self.store(py, checked)
    }

    /// `put_many` of one value.
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.check_open(py)?;
        let (key, payload) = (self.spec.key(key)?, payload(value)?);
        let bytes = payload.as_slice();
        let sealed = self.seal(py, &key, bytes)?;
        let (stored, evicted) = self.admit(key, sealed);
        let n = bytes.len() as u64;
        self.count_puts(
            u64::from(stored),
            if stored { n } else { 0 },
            u64::from(!stored),
            evicted,
        );
        Ok(stored)
    }

    /// The payloads under `keys`, as read-only views; None for a miss. A value that fails a
    /// check is a miss, removed and counted, and `on_corrupt(key, reason)` is called for it.
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.check_open(py)?;
        let full = self.keys_of(keys)?;
        let found: Vec<Option<Py<HostValue>>> = {
            let values = self.shared.values();
            full.iter()
                .map(|k| values.get(k).map(|v| v.clone_ref(py)))
                .collect()
        };
        let hit_keys: Vec<&String> = full
            .iter()
            .zip(&found)
            .filter_map(|(k, f)| f.as_ref().map(|_| k))
            .collect();
        self.shared.index.get().lock().touch(&hit_keys);
        let out = PyList::empty(py);
        let (mut hits, mut hit_bytes, mut corrupt) = (0, 0, 0);
        for (key, value) in full.iter().zip(found) {
            match self.serve(py, key, value)? {
                Served::Hit(view, n) => {
                    (hits, hit_bytes) = (hits + 1, hit_bytes + n);
                    out.append(view)?;
                }
                Served::Corrupt => {
                    corrupt += 1;
                    out.append(py.None())?;
                }
                Served::Miss => out.append(py.None())?,
            }
        }
        let misses = full.len() as u64 - hits;
        self.shared
            .counts
            .count_gets(hits, hit_bytes, misses, corrupt);
        Ok(out)
    }

    /// `get_many` of one key.
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.check_open(py)?;
        self.spec.with_key(key, |full| {
            let value = self.shared.values().get(full).map(|v| v.clone_ref(py));
            if value.is_some() {
                self.shared.index.get().lock().touch(&[full]);
            }
            self.serve_one(py, full, value)
        })?
    }

    /// Takes the value out and returns its payload (checked, as for `get`); None for a miss.
    fn pop<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.check_open(py)?;
        self.spec.with_key(key, |full| {
            let value = self.shared.values().remove(full);
            self.shared.index.get().lock().remove(full);
            self.serve_one(py, full, value)
        })?
    }

    /// Whether a value is stored under `key`.
    fn contains(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.check_open(key.py())?;
        self.spec
            .with_key(key, |full| self.shared.values().contains_key(full))
    }

    /// Deletes the values under `keys`; returns which there were.
    fn delete_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.check_open(keys.py())?;
        let full = self.keys_of(keys)?;
        let gone: Vec<Option<Py<HostValue>>> = {
            let mut values = self.shared.values();
            full.iter().map(|k| values.remove(k)).collect()
        };
        let mut index = self.shared.index.get().lock();
        for key in &full {
            index.remove(key);
        }
        drop(index);
        let done: Vec<bool> = gone.iter().map(Option::is_some).collect();
        drop(gone); // released with the locks given back
        let deleted = done.iter().filter(|&&d| d).count() as u64;
        self.shared.counts.deletes.fetch_add(deleted, Relaxed);
        Ok(done)
    }

    /// The stored keys that start with `prefix`.
    fn scan(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
        self.check_open(py)?;
        Ok(self
            .shared
            .values()
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect())
    }

    /// Closes the store, for every namespace: every call after this raises
    /// `StoreClosedError`, and every value is dropped.
    fn close(&self) {
        self.shared.closed.store(true, Relaxed);
        let values = std::mem::take(&mut *self.shared.values());
        let mut index = self.shared.index.get().lock();
        for key in values.keys() {
            index.remove(key);
        }
        drop(index);
        drop(values);
    }

    /// What the garbage collector follows from here: `on_corrupt` is the store's own method and
    /// the store holds this handle's methods, a cycle only the collector can free (a store
    /// dropped without `close()` would otherwise keep its values forever).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.on_corrupt)?;
        if let Some(alloc) = &self.alloc {
            visit.call(alloc)?;
        }
        Ok(())
    }

    /// How many values the store holds (every namespace's).
    fn __len__(&self) -> usize {
        self.shared.values().len()
    }
}
