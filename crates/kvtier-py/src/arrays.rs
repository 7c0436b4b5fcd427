//! Numpy arrays in: the zero-copy fast path for the right dtype, else `kvtier._arrays`
//! validates and converts (and raises `InvalidArgumentError` saying what was expected).

use numpy::{Element, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

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
    let py = obj.py();
    let converted = py
        .import("kvtier._arrays")?
        .getattr("as_array")?
        .call1((obj, name, dtype))?;
    converted.extract::<PyReadonlyArray1<'py, T>>()
}
