//! `kvtier._core.HostValues`: the values of a host store, so that a put or a get is one call.
//!
//! The engine is `kvtier_store::host::HostValues` (the map, the budget through the store's
//! `StoreIndex`, the checks, the counts); this file converts: a put turns its keys into stored
//! keys and seals each value (header, payload, a zero checksum: host values never leave the
//! process) into a `HostValue` with one copy (into memory of its own, or the caller's pinned
//! buffer), which the engine admits; a get hands out a memoryview of the `HostValue`, whose
//! buffer is exactly its payload, read-only (one new object a get), and reports a value that
//! failed its checks to the store's callback.
//!
//! A `HostValues` is one namespace's handle on the values (with the store's callback for a
//! value that fails its checks), so the store's public methods can be its methods, with no
//! Python in between; `view` gives another namespace's handle on the same values.
//!
//! Nothing that can call into Python (a conversion, an allocation, a release) runs while the
//! engine's locks are held: another thread holding the GIL could wait on them forever. The
//! engine only clones (a reference count) and drops values after its locks.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use numpy::PyArrayMethods;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::gc::{PyTraverseError, PyVisit};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyString};

use kvtier_store::format::{HeaderSpec, CHECKSUM_BYTES};
use kvtier_store::host::{self, Served};

use crate::arrays::{contiguous_buffer, Bytes};
use crate::errors::IntoPy as _;
use crate::store_index::PyStoreIndex;
use crate::store_stats::PyStoreStats;

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

/// One namespace as a host store's calls need it: the prefix of its stored keys and its
/// header (`HeaderSpec`), with the `kvtier.stores.Namespace` itself for keys of other types
/// than `str` and `int`.
struct KeySpec {
    prefix: String,
    header: HeaderSpec,
    namespace: Py<PyAny>,
}

impl KeySpec {
    fn new(namespace: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(KeySpec {
            prefix: namespace.getattr("prefix")?.extract()?,
            header: crate::sealed::header_spec(namespace)?,
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
        &sealed[self.head..sealed.len() - CHECKSUM_BYTES]
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

/// A `HostValue` as the engine holds it.
struct Held(Py<HostValue>);

impl host::Sealed for Held {
    fn sealed(&self) -> &[u8] {
        self.0.get().sealed()
    }
}

/// One namespace's handle on the values of a host store, indexed by the store's `StoreIndex`
/// (budget and eviction order).
#[pyclass(name = "HostValues", module = "kvtier._core", frozen)]
pub struct PyHostValues {
    values: Arc<host::HostValues<Held>>,
    spec: KeySpec,
    /// Called as `on_corrupt(key, reason)` for a value that fails its checks.
    on_corrupt: Py<PyAny>,
    /// `alloc(size)` gives the buffer a value is sealed into (None: memory of its own).
    alloc: Option<Py<PyAny>>,
}

impl PyHostValues {
    /// Raises `kvtier.stores.StoreClosedError` once the store is closed (checked here, not in
    /// Python: it is a tenth of a small get).
    fn check_open(&self, py: Python<'_>) -> PyResult<()> {
        if !self.values.is_closed() {
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
    fn seal(&self, py: Python<'_>, key: &str, payload: &[u8]) -> PyResult<Held> {
        let header = &self.spec.header;
        let memory = match &self.alloc {
            None => Memory::Own(
                header
                    .seal_unchecked(key, payload)
                    .py_err()?
                    .into_boxed_slice(),
            ),
            Some(alloc) => {
                let size = header.sealed_len(key, payload.len());
                let buffer = alloc.bind(py).call1((size,))?;
                let addr = {
                    let array = buffer.cast::<numpy::PyArray1<u8>>()?;
                    let mut rw = array.readwrite();
                    let out = rw.as_slice_mut()?.get_mut(..size).ok_or_else(|| {
                        invalid_argument(py, format!("alloc({size}) is too short"))
                    })?;
                    header.seal_unchecked_into(key, payload, out).py_err()?;
                    out.as_ptr() as usize
                };
                Memory::Given {
                    _buffer: buffer.unbind(),
                    addr,
                    len: size,
                }
            }
        };
        let head = header.header_len(key);
        Ok(Held(Py::new(py, HostValue { memory, head })?))
    }

    /// A read's result as Python gets it: a view of the payload, or None (a miss, or a value
    /// that failed its checks, reported to `on_corrupt`).
    fn served<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        served: Served<Held>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match served {
            Served::Hit { value, .. } => {
                Ok(PyMemoryView::from(value.0.bind(py).as_any())?.into_any())
            }
            Served::Miss => Ok(py.None().into_bound(py)),
            Served::Corrupt(reason) => {
                self.on_corrupt.bind(py).call1((key, reason.to_string()))?;
                Ok(py.None().into_bound(py))
            }
        }
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
            let (stored, gone) = self.values.admit(key, sealed);
            if stored {
                stored_bytes += bytes.len() as u64;
            }
            evicted += gone;
            done.push(stored);
        }
        let stored = done.iter().filter(|&&d| d).count() as u64;
        let refused = done.len() as u64 - stored;
        self.values
            .count_puts(stored, stored_bytes, refused, evicted);
        Ok(done)
    }

    fn keys_of(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        keys.try_iter()?.map(|k| self.spec.key(&k?)).collect()
    }
}

fn clone_held(py: Python<'_>) -> impl Fn(&Held) -> Held + '_ {
    move |v| Held(v.0.clone_ref(py))
}

#[pymethods]
impl PyHostValues {
    /// `namespace`'s handle on new values indexed by `index` (the store's budget and policy),
    /// counted into `stats`; `on_corrupt(key, reason)` hears of a value that fails its checks,
    /// `alloc(size)` gives the buffer a value is sealed into (None: memory of its own).
    #[new]
    #[pyo3(signature = (index, stats, namespace, on_corrupt, alloc = None))]
    fn new(
        index: &PyStoreIndex,
        stats: &PyStoreStats,
        namespace: &Bound<'_, PyAny>,
        on_corrupt: Py<PyAny>,
        alloc: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let values = host::HostValues::new(Arc::clone(&index.inner), Arc::clone(&stats.counts));
        Ok(PyHostValues {
            values: Arc::new(values),
            spec: KeySpec::new(namespace)?,
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
            values: Arc::clone(&self.values),
            spec: KeySpec::new(namespace)?,
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
        Ok(self.values.put(key, sealed, bytes.len() as u64))
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
        let served = self
            .values
            .get_many(&self.spec.header, &full, clone_held(py));
        let out = PyList::empty(py);
        for (key, served) in full.iter().zip(served) {
            out.append(self.served(py, key, served)?)?;
        }
        Ok(out)
    }

    /// `get_many` of one key.
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.check_open(py)?;
        self.spec.with_key(key, |full| {
            let served = self.values.get(&self.spec.header, full, clone_held(py));
            self.served(py, full, served)
        })?
    }

    /// Takes the value out and returns its payload (checked, as for `get`); None for a miss.
    fn pop<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.check_open(py)?;
        self.spec.with_key(key, |full| {
            let served = self.values.pop(&self.spec.header, full);
            self.served(py, full, served)
        })?
    }

    /// Whether a value is stored under `key`.
    fn contains(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.check_open(key.py())?;
        self.spec.with_key(key, |full| self.values.contains(full))
    }

    /// Deletes the values under `keys`; returns which there were.
    fn delete_many(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        self.check_open(keys.py())?;
        let full = self.keys_of(keys)?;
        Ok(self.values.delete_many(&full))
    }

    /// The stored keys that start with `prefix`.
    fn scan(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
        self.check_open(py)?;
        Ok(self.values.scan(prefix))
    }

    /// Closes the store, for every namespace: every call after this raises
    /// `StoreClosedError`, and every value is dropped.
    fn close(&self) {
        self.values.close();
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
        self.values.len()
    }
}
