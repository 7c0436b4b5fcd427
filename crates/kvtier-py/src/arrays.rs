//! Numpy arrays in: the zero-copy fast path for the right dtype, else `kvtier._arrays`
//! validates and converts (and raises `InvalidArgumentError` saying what was expected).

use numpy::npyffi::PY_ARRAY_API;
use numpy::{Element, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyMemoryView};

/// `kvtier._arrays.as_array`, looked up once: an import per call costs more than hashing 64 KiB.
static AS_ARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A contiguous 1-D array of `T` borrowed from `obj`, converting other inputs through
/// `kvtier._arrays.as_array(obj, name, dtype)`.
pub fn array<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    dtype: &str,
) -> PyResult<PyReadonlyArray1<'py, T>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, T>>() {
        if a.is_contiguous() {
            return Ok(a);
        }
    }
    let converted = AS_ARRAY
        .import(obj.py(), "kvtier._arrays", "as_array")?
        .call1((obj, name, dtype))?;
    converted.extract::<PyReadonlyArray1<'py, T>>()
}

/// The bytes of `obj` as a uint8 array: a uint8 array as it is; a `bytes`, `bytearray` or
/// contiguous `memoryview` (of any format: its bytes) wrapped without a copy by numpy's
/// `frombuffer`, called through its C API (a call into Python would cost 2-4 us per value);
/// anything else through [`array`].
pub fn bytes_array<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<PyReadonlyArray1<'py, u8>> {
    // A view that is not contiguous is refused by `wrap_bytes` and copied by `array`.
    match wrap_bytes(obj) {
        Some(a) => Ok(a),
        None => array::<u8>(obj, name, "uint8"),
    }
}

/// The bytes of a `bytes`, `bytearray` or C-contiguous `memoryview` (of any format) as a
/// uint8 array, without a copy; None for anything else.
pub fn wrap_bytes<'py>(obj: &Bound<'py, PyAny>) -> Option<PyReadonlyArray1<'py, u8>> {
    let bytes_like = obj.is_instance_of::<PyMemoryView>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>();
    if !bytes_like {
        return None;
    }
    let py = obj.py();
    // A new reference, which `PyArray_FromBuffer` takes over.
    let descr = numpy::dtype::<u8>(py).into_dtype_ptr();
    // SAFETY: `obj` is alive, `descr` is consumed by the call, and the result is a new
    // reference or null with an exception set, as `from_owned_ptr_or_err` expects.
    let wrapped = unsafe {
        let raw = PY_ARRAY_API.PyArray_FromBuffer(py, obj.as_ptr(), descr, -1, 0);
        Bound::from_owned_ptr_or_err(py, raw)
    };
    wrapped
        .and_then(|w| w.extract::<PyReadonlyArray1<'py, u8>>())
        .ok()
}

/// The buffer `value` exports, when it exports a C-contiguous one.
pub(crate) fn contiguous_buffer(value: &Bound<'_, PyAny>) -> Option<PyUntypedBuffer> {
    PyUntypedBuffer::get(value)
        .ok()
        .filter(PyUntypedBuffer::is_c_contiguous)
}

/// Bytes held by Python: a `bytes` (the commonest payload), or any other buffer, exported.
pub(crate) enum Bytes<'py> {
    Bytes(Bound<'py, PyBytes>),
    Buffer(PyUntypedBuffer),
}

impl<'py> Bytes<'py> {
    /// The bytes of a `bytes`, or of any object that exports a C-contiguous buffer.
    pub(crate) fn of(value: &Bound<'py, PyAny>) -> Option<Self> {
        match value.cast_exact::<PyBytes>() {
            Ok(b) => Some(Bytes::Bytes(b.clone())),
            Err(_) => contiguous_buffer(value).map(Bytes::Buffer),
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Bytes(b) => b.as_bytes(),
            // SAFETY: a C-contiguous buffer of `len_bytes` bytes at `buf_ptr`, exported (so kept
            // in place, unresized) until `buffer` is dropped. (Read without the GIL, a writable
            // one may be written by another thread meanwhile: that changes what is read, which
            // a checksum then refuses, as it would a value written while it was being stored.)
            Bytes::Buffer(buffer) => unsafe {
                std::slice::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes())
            },
        }
    }
}
