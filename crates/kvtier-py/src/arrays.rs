//! Numpy arrays in: the zero-copy fast path for the right dtype, else `kvtier._arrays`
//! validates and converts (and raises `InvalidArgumentError` saying what was expected).

use numpy::npyffi::PY_ARRAY_API;
use numpy::{Element, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArrayMethods};
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
