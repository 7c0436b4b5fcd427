//! The sealed value format (`kvtier_store::format`) for Python: its constants (`FORMAT_*`), the
//! header encoder and the checks (`unseal`) that `kvtier.stores.format` seals and reads values
//! with, for the stores that live in Python (Redis) and the tests. Defined once, in the store
//! crate: nothing here restates the layout.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PySlice};

use kvtier_store::format::{self, HeaderSpec};
use kvtier_store::Refusal;

use crate::arrays::Bytes;
use crate::errors::IntoPy as _;

/// Adds the format's constants to the module: `FORMAT_MAGIC` (bytes), `FORMAT_VERSION`,
/// `FORMAT_CHECKSUM_BYTES` (the trailing checksum field) and `FORMAT_OVERHEAD` (bytes a value
/// adds to its payload beyond its header texts).
pub fn add_constants(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FORMAT_MAGIC", PyBytes::new(m.py(), format::MAGIC))?;
    m.add("FORMAT_VERSION", format::FORMAT_VERSION)?;
    m.add("FORMAT_CHECKSUM_BYTES", format::CHECKSUM_BYTES)?;
    m.add("FORMAT_OVERHEAD", format::OVERHEAD)?;
    Ok(())
}

/// `kvtier.errors.PayloadError(reason)`, to raise or to hand back in a batch's results.
pub(crate) fn payload_error(py: Python<'_>, reason: &Refusal) -> PyErr {
    match py
        .import("kvtier.errors")
        .and_then(|m| m.getattr("PayloadError"))
        .and_then(|class| class.call1((reason.to_string(),)))
    {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// The header of a value of `length` payload bytes stored under `key` in the namespace `digest`
/// whose packed texts after the key are `texts` (`Namespace.packed_texts`).
#[pyfunction]
pub fn seal_header<'py>(
    py: Python<'py>,
    digest: u64,
    key: &str,
    texts: &[u8],
    length: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut head = Vec::new();
    format::write_header(&mut head, digest, key.as_bytes(), texts, length).py_err()?;
    Ok(PyBytes::new(py, &head))
}

/// `texts`, each as a header stores it (a u16 length, then UTF-8).
#[pyfunction]
#[pyo3(signature = (*texts))]
pub fn pack_texts<'py>(py: Python<'py>, texts: Vec<String>) -> PyResult<Bound<'py, PyBytes>> {
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    Ok(PyBytes::new(py, &format::pack_texts(&texts).py_err()?))
}

/// The key a stored value (bytes or any contiguous buffer) says it was written under, or None
/// when its header is unreadable.
#[pyfunction]
pub fn read_key(value: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    Ok(format::read_key(buffer_of(value)?.as_slice()))
}

fn buffer_of<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bytes<'py>> {
    Bytes::of(value).ok_or_else(|| {
        crate::errors::to_py(kvtier::Error::InvalidArgument {
            what: "value",
            reason: format!(
                "expected bytes or a contiguous buffer, got {}",
                value
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ),
        })
    })
}

/// The payload of a stored value (a `bytes` or any contiguous buffer) as a read-only
/// memoryview, after every check of the format, the checksum computed here without the GIL
/// (`verify = false` skips only it); raises `PayloadError` naming the check that failed.
#[pyfunction]
#[pyo3(signature = (value, digest, texts, *, verify = true))]
pub fn unseal<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    digest: u64,
    texts: &[u8],
    verify: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let bytes = buffer_of(value)?;
    let want = format::Expected {
        digest,
        texts: &[texts],
    };
    let sealed = bytes.as_slice();
    let span = py
        .detach(|| format::check(sealed, None, &want, verify))
        .map_err(|reason| payload_error(py, &reason))?;
    let (readonly, bytewise) = match &bytes {
        Bytes::Bytes(_) => (true, true),
        Bytes::Buffer(b) => (b.readonly(), b.dimensions() == 1 && b.format() == c"B"),
    };
    read_only_span(value, span.start, span.end, bytewise, readonly)
}

/// Bytes `start..stop` of `value`'s buffer as a read-only memoryview (`bytewise`: its buffer
/// is already 1-D bytes; `readonly`: it is already read-only).
pub(crate) fn read_only_span<'py>(
    value: &Bound<'py, PyAny>,
    start: usize,
    stop: usize,
    bytewise: bool,
    readonly: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    let mut view = PyMemoryView::from(value)?.into_any();
    if !bytewise {
        view = view.call_method1(intern!(py, "cast"), ("B",))?; // slices count bytes
    }
    // Spans within one allocation, so within isize.
    let view = view.get_item(PySlice::new(py, start as isize, stop as isize, 1))?;
    if readonly {
        Ok(view)
    } else {
        view.call_method0(intern!(py, "toreadonly"))
    }
}

/// What one namespace writes into a value's header and checks on reading it, read from a
/// `kvtier.stores.Namespace`.
pub(crate) fn header_spec(namespace: &Bound<'_, PyAny>) -> PyResult<HeaderSpec> {
    Ok(HeaderSpec::new(
        namespace.getattr("digest")?.extract()?,
        namespace.getattr("packed_texts")?.extract()?,
    ))
}
